"""The wire format of requests and results: one message per Kafka record, in one of two versions.

Version 2, written for messages of dense numeric tensors only (the common case, and the fast one):
`CST2`, uint16 uri length, the uri (UTF-8), uint32 layout length, the layout (UTF-8 JSON:
{"tensors": [[name, dtype, shape], ...]} and, for results, "batch_size" and "inference_us"), then
each tensor's values, little-endian, C order, back to back in layout order. Decoding is a header
read and a numpy view per tensor; a batch of results shares one layout, written once.

Version 1, for everything else (strings, images, sparse tensors, errors, top-N results), and read
for all: one Arrow IPC stream (the README has the full description):
- schema metadata `cs.version` = "1", `cs.uri` = the request's uri, and for results optionally
  `cs.error` (the error message; no tensors then), `cs.batch_size` (the batch it ran in),
  `cs.inference_us` (that batch's inference time in microseconds) and `cs.top_n` (the result is
  the N best classes: tensors `classes` and `probabilities`);
- one column per named value, exactly one row, field metadata `cs.dtype` and `cs.shape`:
  - dense tensor: large_list<T>, the values flattened in C order; `cs.dtype` a numpy dtype name
    (or "str"), `cs.shape` a JSON list of ints;
  - sparse tensor (`cs.layout` = "coo"): struct<indices: large_list<int64>, values: large_list<T>>,
    one row of `rank` indices per value; `cs.shape` is the dense shape;
  - encoded image (`cs.dtype` = "image"): large_list<large_binary> holding the JPEG/PNG bytes,
    decoded by the job; `cs.shape` = "[]".

Arrow is a maintained, language-neutral format with a fuzzed reader; numeric tensors are written
and read without copying. Nothing here builds arbitrary objects: dtypes come from an allow-list
and every shape is checked against its payload.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

FORMAT_VERSION = "1"
MAX_TENSORS = 64
MAX_RANK = 16
MAX_URI_CHARS = 1024
NUMERIC_DTYPES = frozenset(
    {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
     "float16", "float32", "float64"}
)
STRING_DTYPE = "str"
IMAGE_DTYPE = "image"
SPARSE_LAYOUT = "coo"
# The two tensors of a top-N result (metadata cs.top_n).
TOP_N_CLASSES = "classes"
TOP_N_PROBABILITIES = "probabilities"
END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"
ALLOWED_DTYPES = NUMERIC_DTYPES | {STRING_DTYPE}  # of dense tensors


class DecodeError(ValueError):
    """The bytes are not a valid message of a known format version."""


@dataclass(frozen=True)
class SparseTensor:
    """A COO sparse tensor: `indices` holds one row of len(shape) indices per value."""

    indices: np.ndarray  # (nnz, rank) int64
    values: np.ndarray  # (nnz,)
    shape: tuple[int, ...]

    def check(self, max_dense_bytes: int) -> None:
        """Raises ValueError unless the parts agree, every index is in bounds and the dense
        tensor stays within `max_dense_bytes` (it is densified before inference)."""
        nnz, rank = len(self.values), len(self.shape)
        if self.values.ndim != 1 or self.indices.shape != (nnz, rank):
            raise ValueError(
                f"{nnz} values need indices of shape ({nnz}, {rank}), got {self.indices.shape}"
            )
        if self.indices.dtype.kind not in "iu":
            raise ValueError(f"indices must be integers, got {self.indices.dtype}")
        if nnz and (self.indices.min() < 0 or np.any(self.indices.max(axis=0) >= np.array(self.shape))):
            raise ValueError(f"an index is outside the shape {list(self.shape)}")
        dense_bytes = math.prod(self.shape) * self.values.dtype.itemsize
        if dense_bytes > max_dense_bytes:
            raise ValueError(f"{dense_bytes} bytes once dense, over the limit of {max_dense_bytes}")

    def to_dense(self) -> np.ndarray:
        dense = np.zeros(self.shape, dtype=self.values.dtype)
        if len(self.values):
            dense[tuple(self.indices.T)] = self.values
        return dense


@dataclass(frozen=True)
class EncodedImage:
    """A JPEG/PNG file's bytes, decoded by the job as its config says for that input."""

    data: bytes


Value = np.ndarray | SparseTensor | EncodedImage


@dataclass
class Message:
    """A decoded request or result."""

    uri: str
    tensors: dict[str, Value] = field(default_factory=dict)
    error: str | None = None
    batch_size: int | None = None
    inference_us: int | None = None
    top_n: int | None = None
    # Version 2 messages only: their layout's bytes. Messages with equal keys hold tensors of the
    # same names, dtypes and shapes, so the job checks one and stacks them all.
    layout_key: bytes | None = field(default=None, compare=False, repr=False)


def dtype_name(array: np.ndarray) -> str:
    """The wire name of an array's dtype; numpy's unicode and object-of-str arrays are 'str'."""
    if array.dtype.kind in "UO":
        return STRING_DTYPE
    return array.dtype.name


def encode_message(message: Message, version: int | None = None) -> bytes:
    """Serialises a message in `version`, by default version 2 when it can carry the message;
    refuses dtypes outside the allow-list and inconsistent sparse tensors."""
    if len(message.uri) > MAX_URI_CHARS:
        raise ValueError(f"uri longer than {MAX_URI_CHARS} characters")
    if version != 1 and _fits_v2(message):
        return _encode_v2(message)
    fields, columns = [], []
    for name, value in message.tensors.items():
        try:
            column, metadata = _value_column(value)
        except ValueError as exc:
            raise ValueError(f"tensor {name!r}: {exc}") from None
        fields.append(pa.field(name, column.type, metadata=metadata))
        columns.append(column)
    metadata = {"cs.version": FORMAT_VERSION, "cs.uri": message.uri}
    for key, item in (
        ("cs.error", message.error),
        ("cs.batch_size", message.batch_size),
        ("cs.inference_us", message.inference_us),
        ("cs.top_n", message.top_n),
    ):
        if item is not None:
            metadata[key] = str(item)
    schema = pa.schema(fields, metadata=metadata)
    batch = pa.record_batch(columns, schema=schema)
    # Schema message, batch message, end-of-stream marker: the bytes pa.ipc.new_stream writes,
    # at less than half its cost per message.
    return schema.serialize().to_pybytes() + batch.serialize().to_pybytes() + END_OF_STREAM


def _value_column(value: Value) -> tuple[pa.Array, dict[str, str]]:
    """A value's one-row column and its field metadata."""
    if isinstance(value, EncodedImage):
        if not value.data:
            raise ValueError("empty image")
        column = _one_row(pa.array([value.data], pa.large_binary()))
        return column, {"cs.dtype": IMAGE_DTYPE, "cs.shape": "[]"}
    if isinstance(value, SparseTensor):
        kind = _numeric_kind(value.values)
        value.check(max_dense_bytes=2**63)
        parts = [_tensor_column(np.asarray(value.indices, np.int64), "int64"), _tensor_column(value.values, kind)]
        column = pa.StructArray.from_arrays(parts, names=["indices", "values"])
        return column, {"cs.dtype": kind, "cs.shape": _json_shape(value.shape), "cs.layout": SPARSE_LAYOUT}
    array = np.asarray(value)
    kind = dtype_name(array)
    if kind not in ALLOWED_DTYPES:
        raise ValueError(f"dtype {array.dtype} is not supported")
    return _tensor_column(array, kind), {"cs.dtype": kind, "cs.shape": _json_shape(array.shape)}


def _numeric_kind(array: np.ndarray) -> str:
    kind = dtype_name(array)
    if kind not in NUMERIC_DTYPES:
        raise ValueError(f"sparse values must be numbers, got dtype {array.dtype}")
    return kind


def _json_shape(shape: tuple[int, ...]) -> str:
    return "[" + ",".join(str(int(dim)) for dim in shape) + "]"  # a JSON list, written fast


def _one_row(values: pa.Array) -> pa.Array:
    offsets = pa.py_buffer(np.array([0, len(values)], dtype=np.int64))
    return pa.Array.from_buffers(pa.large_list(values.type), 1, [None, offsets], children=[values])


def _tensor_column(array: np.ndarray, kind: str) -> pa.Array:
    """A one-row large_list column holding the tensor's values in C order."""
    if kind == STRING_DTYPE:
        values = pa.array([str(item) for item in array.ravel()], pa.large_string())
    elif kind == "bool":
        values = pa.array(array.ravel())  # Arrow packs booleans into bits
    else:
        # Numeric values are wrapped, not converted: ~1 us instead of ~23 us for pa.array().
        flat = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("=")).reshape(-1)
        values = pa.Array.from_buffers(pa.from_numpy_dtype(flat.dtype), flat.size, [None, pa.py_buffer(flat)])
    return _one_row(values)


def decode_message(payload: bytes, max_bytes: int) -> Message:
    """Parses and validates a message; every problem raises DecodeError with a readable reason."""
    if len(payload) > max_bytes:
        raise DecodeError(f"message of {len(payload)} bytes exceeds the limit of {max_bytes}")
    if payload[:4] == V2_MAGIC:
        return _decode_v2(payload)
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
    if not uri or len(uri) > MAX_URI_CHARS:
        raise DecodeError("missing or over-long uri")
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
        batch_size=_count(metadata.get("cs.batch_size")),
        inference_us=_count(metadata.get("cs.inference_us")),
        top_n=_count(metadata.get("cs.top_n")),
    )


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
        raise DecodeError(f"{buffer_bytes} bytes once decoded, over the limit of {max_bytes}")
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


def _decode_value(spec: pa.Field, column: pa.Array, max_bytes: int) -> Value:
    name = spec.name
    metadata = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in (spec.metadata or {}).items()}
    kind = metadata.get("cs.dtype")
    if kind == IMAGE_DTYPE:
        return _decode_image(name, column)
    if kind not in ALLOWED_DTYPES:
        raise DecodeError(f"tensor {name!r}: dtype {kind!r} is not allowed")
    shape = _shape(name, metadata.get("cs.shape"))
    layout = metadata.get("cs.layout")
    if layout == SPARSE_LAYOUT:
        return _decode_sparse(name, kind, shape, column, max_bytes)
    if layout is not None:
        raise DecodeError(f"tensor {name!r}: unknown layout {layout!r}")
    return _decode_tensor(name, kind, shape, column)


def _decode_image(name: str, column: pa.Array) -> EncodedImage:
    if column.type != pa.large_list(pa.large_binary()):
        raise DecodeError(f"image {name!r}: must be a large_list<large_binary> column")
    values = column.flatten()
    if len(values) != 1 or values.null_count or not values[0].as_py():
        raise DecodeError(f"image {name!r}: must hold exactly one non-empty encoded image")
    return EncodedImage(values[0].as_py())


def _decode_sparse(name: str, kind: str, shape: tuple[int, ...], column: pa.Array, max_bytes: int) -> SparseTensor:
    if kind not in NUMERIC_DTYPES:
        raise DecodeError(f"sparse tensor {name!r}: dtype {kind!r} is not a number type")
    if not pa.types.is_struct(column.type) or [f.name for f in column.type] != ["indices", "values"]:
        raise DecodeError(f"sparse tensor {name!r}: must be a struct of indices and values")
    indices_column, values_column = column.flatten()
    indices = _decode_tensor(f"{name}.indices", "int64", None, indices_column)
    values = _decode_tensor(f"{name}.values", kind, None, values_column)
    if len(values) * len(shape) != len(indices):
        raise DecodeError(f"sparse tensor {name!r}: {len(indices)} indices for {len(values)} values of rank {len(shape)}")
    sparse = SparseTensor(indices.reshape(len(values), len(shape)), values, shape)
    try:
        sparse.check(max_dense_bytes=max_bytes)
    except ValueError as exc:
        raise DecodeError(f"sparse tensor {name!r}: {exc}") from None
    return sparse


def _decode_tensor(name: str, kind: str, shape: tuple[int, ...] | None, column: pa.Array) -> np.ndarray:
    """A dense tensor; `shape` None: a flat one of whatever length the column holds."""
    if not pa.types.is_large_list(column.type):
        raise DecodeError(f"tensor {name!r}: values must be a large_list column")
    values = column.flatten()  # the row's values, honouring the list offsets
    if shape is None:
        shape = (len(values),)
    expected = pa.large_string() if kind == STRING_DTYPE else pa.from_numpy_dtype(np.dtype(kind))
    if values.type != expected:
        raise DecodeError(f"tensor {name!r}: values of type {values.type} do not match dtype {kind}")
    if len(values) != math.prod(shape):
        raise DecodeError(f"tensor {name!r}: {len(values)} values do not fill shape {shape}")
    if values.null_count:
        raise DecodeError(f"tensor {name!r}: null values")
    if kind == STRING_DTYPE:
        return np.array(values.to_pylist(), dtype=object).reshape(shape)
    if kind == "bool":
        return values.to_numpy(zero_copy_only=False).reshape(shape)
    dtype = np.dtype(kind)
    if len(values) == 0:
        return np.empty(shape, dtype=dtype)
    # A view of the message's buffer (validated above): ~1 us instead of ~11 us for to_numpy().
    data = values.buffers()[1]
    return np.frombuffer(data, dtype=dtype, count=len(values), offset=values.offset * dtype.itemsize).reshape(shape)


def _shape(name: str, text: str | None) -> tuple[int, ...]:
    try:
        shape = json.loads(text or "")
    except ValueError:
        raise DecodeError(f"tensor {name!r}: shape is not a JSON list") from None
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_RANK
        or not all(isinstance(dim, int) and not isinstance(dim, bool) and 0 <= dim < 2**31 for dim in shape)
    ):
        raise DecodeError(f"tensor {name!r}: invalid shape {text!r}")
    return tuple(shape)


# Format version 2: dense numeric tensors as raw bytes behind a small header.
V2_MAGIC = b"CST2"  # an Arrow IPC stream starts with 0xFFFFFFFF: the two never meet
_V2_URI = struct.Struct("<4sH")
MAX_LAYOUT_BYTES = 64 * 1024


# numpy's one-letter type codes of the number dtypes (dtype.name is computed in Python, ~3 us).
_V2_CHARS = {np.dtype(name).char: name for name in NUMERIC_DTYPES} | {"l": "int64", "L": "uint64"}


def _fits_v2(message: Message) -> bool:
    return message.error is None and message.top_n is None and _v2_tensors(message.tensors)


def _v2_tensors(tensors: dict[str, Value]) -> bool:
    """Whether version 2 carries these values: dense arrays of number dtypes only."""
    return all(isinstance(value, np.ndarray) and value.dtype.char in _V2_CHARS for value in tensors.values())


def _encode_v2(message: Message) -> bytes:
    """The one-row case of encode_rows."""
    rows = {name: value[np.newaxis] for name, value in message.tensors.items()}
    return encode_rows([message.uri], rows, message.batch_size, message.inference_us)[0]


def encode_rows(
    uris: list[str], tensors: dict[str, np.ndarray], batch_size: int | None = None, inference_us: int | None = None
) -> list[bytes]:
    """One message per uri, holding row i of every stacked tensor (first dimension len(uris)): the
    results of one batched run. Version 2 shares one layout and one copy of each tensor among the
    rows; other dtypes (strings) go through encode_message row by row."""
    if not _v2_tensors(tensors):
        return [
            encode_message(Message(uri, {name: value[i] for name, value in tensors.items()}, batch_size=batch_size,
                                   inference_us=inference_us))
            for i, uri in enumerate(uris)
        ]
    count = len(uris)
    arrays = [_little_endian(value) for value in tensors.values()]
    spec = tuple((name, _V2_CHARS[array.dtype.char], array.shape[1:]) for name, array in zip(tensors, arrays))
    layout = _v2_layout(spec, batch_size, inference_us)
    tail = _U32.pack(len(layout)) + layout
    rows = [memoryview(array.reshape(-1).view(np.uint8)) for array in arrays]
    sizes = [array.nbytes // count if count else 0 for array in arrays]
    messages = []
    for i, uri in enumerate(uris):
        key = uri.encode()
        parts = [_V2_URI.pack(V2_MAGIC, len(key)), key, tail]
        parts += [row[i * size:(i + 1) * size] for row, size in zip(rows, sizes)]
        messages.append(b"".join(parts))
    return messages


def _little_endian(array: np.ndarray) -> np.ndarray:
    return np.asarray(array, array.dtype.newbyteorder("<"), order="C")


@functools.lru_cache(maxsize=64)
def _v2_layout(spec: tuple, batch_size: int | None, inference_us: int | None) -> bytes:
    """The layout JSON of a tensor spec; cached, since a stream of messages repeats a few."""
    layout: dict = {"tensors": [[name, kind, list(shape)] for name, kind, shape in spec]}
    for key, item in (("batch_size", batch_size), ("inference_us", inference_us)):
        if item is not None:
            layout[key] = item
    return json.dumps(layout, separators=(",", ":")).encode()


def _decode_v2(payload: bytes) -> Message:
    try:
        _, uri_length = _V2_URI.unpack_from(payload, 0)
        at = _V2_URI.size + uri_length
        uri = str(payload[_V2_URI.size:at], "utf-8")
        (layout_length,) = _U32.unpack_from(payload, at)
    except (struct.error, UnicodeDecodeError):
        raise DecodeError("not a cluster-serving message: a version 2 header cut short or not UTF-8") from None
    if not uri or len(uri) > MAX_URI_CHARS:
        raise DecodeError("missing or over-long uri")
    at += 4
    if layout_length > MAX_LAYOUT_BYTES or at + layout_length > len(payload):
        raise DecodeError(f"version 2 layout of {layout_length} bytes does not fit the message")
    layout = bytes(payload[at:at + layout_length])
    tensors, needed, batch_size, inference_us = _v2_parse_layout(layout)
    at += layout_length
    if needed != len(payload) - at:
        raise DecodeError(f"version 2 layout needs {needed} bytes of values, the message has {len(payload) - at}")
    values = {}
    for name, dtype, shape, nbytes in tensors:
        values[name] = np.frombuffer(payload, dtype, math.prod(shape), at).reshape(shape)
        at += nbytes
    return Message(uri=uri, tensors=values, batch_size=batch_size, inference_us=inference_us, layout_key=layout)


@functools.lru_cache(maxsize=64)
def _v2_parse_layout(
    text: bytes,
) -> tuple[list[tuple[str, np.dtype, tuple[int, ...], int]], int, int | None, int | None]:
    """The checked layout: (name, dtype, shape, bytes) per tensor, the bytes of all the values,
    batch size, inference time.
    Cached (a failed parse raises and is not), so a stream of like messages parses it once."""
    try:
        layout = json.loads(text)
    except ValueError:
        raise DecodeError("version 2 layout is not JSON") from None
    entries = layout.get("tensors") if isinstance(layout, dict) else None
    if not isinstance(entries, list) or len(entries) > MAX_TENSORS:
        raise DecodeError(f"version 2 layout must list at most {MAX_TENSORS} tensors")
    tensors = []
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and entry[1] in NUMERIC_DTYPES):
            raise DecodeError(f"version 2 tensor entry {str(entry)[:100]} is not [name, number dtype, shape]")
        name, dtype = entry[0], np.dtype(entry[1]).newbyteorder("<")
        shape = _shape(name, json.dumps(entry[2]))
        tensors.append((name, dtype, shape, math.prod(shape) * dtype.itemsize))
    names = [name for name, *_ in tensors]
    if len(set(names)) != len(names):
        raise DecodeError("a tensor name appears more than once")
    needed = sum(nbytes for *_, nbytes in tensors)
    return tensors, needed, _layout_count(layout, "batch_size"), _layout_count(layout, "inference_us")


def _layout_count(layout: dict, key: str) -> int | None:
    item = layout.get(key)
    return item if isinstance(item, int) and not isinstance(item, bool) and 0 <= item < 2**63 else None
