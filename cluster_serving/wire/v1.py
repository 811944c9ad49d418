"""Format version 1 (see connectors/wire): one Arrow IPC stream per message, each value a column
that its kind writes and reads. The stream is read message by message and its IPC metadata
checked before pyarrow inflates or wraps anything."""

from __future__ import annotations

import struct

import pyarrow as pa

from cluster_serving.wire.kinds import KINDS, kind_of
from cluster_serving.wire.values import MAX_TENSORS, DecodeError, Message, TooLarge, Value, check_uri

FORMAT_VERSION = "1"
END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def encode(message: Message) -> bytes:
    fields, columns = [], []
    for name, value in message.tensors.items():
        try:
            column, metadata = kind_of(value).to_column(value)
        except ValueError as exc:
            raise ValueError(f"tensor {name!r}: {exc}") from None
        fields.append(pa.field(name, column.type, metadata=metadata))
        columns.append(column)
    metadata = {"cs.version": FORMAT_VERSION, "cs.uri": message.uri}
    for key, item in (
        ("cs.error", message.error),
        ("cs.error_code", message.error_code),
        ("cs.batch_size", message.batch_size),
        ("cs.inference_us", message.inference_us),
        ("cs.top_n", message.top_n),
        ("cs.model", message.model),
        ("cs.model_version", message.model_version),
    ):
        if item is not None:
            metadata[key] = str(item)
    schema = pa.schema(fields, metadata=metadata)
    batch = pa.record_batch(columns, schema=schema)
    # Schema message, batch message, end-of-stream marker: the bytes pa.ipc.new_stream writes,
    # at less than half its cost per message.
    return schema.serialize().to_pybytes() + batch.serialize().to_pybytes() + END_OF_STREAM


def decode(payload: bytes, max_bytes: int) -> Message:
    schema, batch = _read_stream(payload, max_bytes)
    try:
        return _message(schema, batch, max_bytes)
    except UnicodeDecodeError:  # pyarrow decodes field names as it meets them, and they may be any bytes
        raise DecodeError("not a cluster-serving message: a name in its schema is not UTF-8") from None


def _message(schema: pa.Schema, batch: pa.RecordBatch, max_bytes: int) -> Message:
    """The message a schema and its record batch hold, once checked."""
    metadata = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in (schema.metadata or {}).items()}
    version = metadata.get("cs.version")
    if version != FORMAT_VERSION:
        raise DecodeError(f"unsupported format version {version!r} (this build reads {FORMAT_VERSION!r})")
    uri = metadata.get("cs.uri", "")
    check_uri(uri)
    if batch.num_columns and batch.num_rows != 1:
        raise DecodeError("a message must hold exactly one row")  # error results have no columns
    if batch.num_columns > MAX_TENSORS:
        raise DecodeError(f"more than {MAX_TENSORS} tensors")
    names = schema.names
    if len(set(names)) != len(names):
        duplicate = next(name for name in names if names.count(name) > 1)
        raise DecodeError(f"tensor {duplicate!r} appears more than once")
    for name, spec in zip(names, schema):
        if not _format_type(spec.type):
            raise DecodeError(f"tensor {name!r}: column type {spec.type} is not part of the format")
    try:
        batch.validate(full=True)
    except pa.ArrowException as exc:
        raise DecodeError(f"corrupt message: {exc}") from None
    tensors = {name: _decode_value(schema.field(i), batch.column(i), max_bytes) for i, name in enumerate(names)}
    return Message(
        uri=uri,
        tensors=tensors,
        error=metadata.get("cs.error"),
        error_code=metadata.get("cs.error_code"),
        batch_size=_count(metadata.get("cs.batch_size")),
        inference_us=_count(metadata.get("cs.inference_us")),
        top_n=_count(metadata.get("cs.top_n")),
        model=metadata.get("cs.model"),
        model_version=_count(metadata.get("cs.model_version")),
    )


def _decode_value(spec: pa.Field, column: pa.Array, max_bytes: int) -> Value:
    metadata = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in (spec.metadata or {}).items()}
    for kind in KINDS:  # a loop, not next(): half the cost; the dense kind, last, reads any column
        if kind.reads_column(metadata):
            break
    return kind.from_column(spec.name, metadata, column, max_bytes)


def _read_stream(payload: bytes, max_bytes: int) -> tuple[pa.Schema, pa.RecordBatch]:
    """The stream's schema and its one record batch, read message by message so that nothing is
    inflated before it is checked: pa.ipc.open_stream would decompress an LZ4/ZSTD body (a few KB
    on the wire, any size once inflated) first. Our encoder never compresses, and the format has
    no dictionaries."""
    try:
        messages = list(pa.ipc.MessageReader.open_stream(pa.py_buffer(payload)))
    except (pa.ArrowException, ValueError, OSError) as exc:
        raise DecodeError(f"not a cluster-serving message: {exc}") from None
    if [message.type for message in messages] != ["schema", "record batch"]:
        kinds = ", ".join(message.type for message in messages) or "nothing"
        raise DecodeError(f"not a cluster-serving message: a schema and one record batch expected, got {kinds}")
    compressed, buffer_bytes = _batch_layout(messages[1].metadata.to_pybytes())
    if compressed:
        raise DecodeError("compressed record batches are not part of the format")
    if buffer_bytes > max_bytes:  # buffers may overlap on the wire: the same bytes, seen many times
        raise TooLarge(f"{buffer_bytes} bytes once decoded, over the limit of {max_bytes}")
    try:
        schema = pa.ipc.read_schema(messages[0])
        return schema, pa.ipc.read_record_batch(messages[1], schema)
    except (pa.ArrowException, ValueError, OSError) as exc:
        raise DecodeError(f"not a cluster-serving message: {exc}") from None


# IPC metadata is a flatbuffer (Arrow's format/Message.fbs), and pyarrow says neither whether a
# batch is compressed nor how many bytes its buffers add up to, so _batch_layout reads just that.
MESSAGE_HEADER_FIELD = 2  # Message.header: here the RecordBatch table
RECORD_BATCH_BUFFERS_FIELD = 2  # RecordBatch.buffers: [Buffer {offset: int64, length: int64}]
RECORD_BATCH_COMPRESSION_FIELD = 3  # RecordBatch.compression: absent unless the body is compressed
_U16, _U32, _I32 = struct.Struct("<H"), struct.Struct("<I"), struct.Struct("<i")


def _batch_layout(metadata: bytes) -> tuple[bool, int]:
    """Whether a record batch message declares a compressed body, and how many bytes its buffers
    take once read (each buffer counted, overlapping ones too: they are the same bytes seen twice,
    and copied twice later)."""
    header = _field(metadata, _table(metadata, 0), MESSAGE_HEADER_FIELD)  # the root table first
    if header is None:
        return False, 0  # no RecordBatch at all: pa.ipc.read_record_batch refuses it
    batch = _table(metadata, header)
    buffers = _field(metadata, batch, RECORD_BATCH_BUFFERS_FIELD)
    compressed = _field(metadata, batch, RECORD_BATCH_COMPRESSION_FIELD) is not None
    return compressed, 0 if buffers is None else _buffer_bytes(metadata, _table(metadata, buffers))


def _buffer_bytes(data: bytes, vector: int) -> int:
    """The lengths of a vector of Buffer structs added up: a uint32 count, then 16 bytes each."""
    count = _read(_U32, data, vector)
    if count > (len(data) - vector - 4) // 16:
        raise DecodeError("corrupt message: metadata offset out of bounds")
    fields = struct.unpack_from(f"<{2 * count}q", data, vector + 4)
    return sum(map(abs, fields[1::2]))  # Arrow refuses negative lengths; they must not cancel out


def _table(data: bytes, at: int) -> int:
    """The position of the table that the uoffset stored at `at` points to."""
    return at + _read(_U32, data, at)


def _field(data: bytes, table: int, index: int) -> int | None:
    """The position of a table's field `index`, None when absent. The table starts with a soffset
    back to its vtable: the vtable's byte size, the table's, then one uint16 offset per field."""
    vtable = table - _read(_I32, data, table)
    entry = 4 + 2 * index
    if entry + 2 > _read(_U16, data, vtable):
        return None  # the vtable ends before this field: written by an older schema, absent
    offset = _read(_U16, data, vtable + entry)
    return table + offset if offset else None


def _read(kind: struct.Struct, data: bytes, at: int) -> int:
    """One little-endian integer; hostile offsets end here, not outside the buffer."""
    if not 0 <= at <= len(data) - kind.size:
        raise DecodeError("corrupt message: metadata offset out of bounds")
    return kind.unpack_from(data, at)[0]


def _format_type(kind: pa.DataType) -> bool:
    """Whether a column type is built only of what the format uses: large lists and structs of
    numbers, booleans, large strings and large binaries. pyarrow reads other types from a stream
    that it cannot then wrap as arrays (an interval column raised KeyError, found by fuzzing)."""
    if pa.types.is_large_list(kind):
        return _format_type(kind.value_type)
    if pa.types.is_struct(kind):
        return all(_format_type(kind.field(i).type) for i in range(kind.num_fields))
    return (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)
            or pa.types.is_large_string(kind) or pa.types.is_large_binary(kind))


def _count(text: str | None) -> int | None:
    """An optional non-negative integer of the metadata; anything else is ignored, not trusted."""
    return int(text) if text and text.isascii() and text.isdigit() and len(text) < 19 else None
