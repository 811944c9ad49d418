"""Format version 2 (see connectors/wire): dense numeric tensors as raw bytes behind a small
header, for the common case at a header read and a numpy view per tensor, and encoded images as
their bytes behind a length; whatever else a message holds goes in version 1."""

from __future__ import annotations

import functools
import json
import math
import struct
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import numpy as np

from cluster_serving.wire.values import (
    IMAGE_DTYPE,
    MAX_TENSORS,
    NUMERIC_DTYPES,
    DecodeError,
    EncodedImage,
    Message,
    Value,
    check_uri,
    parse_shape,
)

V2_MAGIC = b"CST2"  # an Arrow IPC stream starts with 0xFFFFFFFF: the two never meet
_URI = struct.Struct("<4sH")  # the magic, the uri's length
_LAYOUT_LENGTH = struct.Struct("<I")
_IMAGE_LENGTH = struct.Struct("<I")  # before an image's bytes in the values
MAX_LAYOUT_BYTES = 64 * 1024

class Served(NamedTuple):
    """What a result's layout says of how it was served: the same for every row of a batch."""

    batch_size: int | None = None
    inference_us: int | None = None
    model: str | None = None
    model_version: int | None = None


# numpy's one-letter type codes of the number dtypes (dtype.name is computed in Python, slowly).
_CHARS = {np.dtype(name).char: name for name in NUMERIC_DTYPES} | {"l": "int64", "L": "uint64"}
# The number dtypes that go as they are, little-endian (or of one byte), by dtype: one dict lookup.
_LITTLE_ENDIAN = {np.dtype(name).newbyteorder("<"): name for name in NUMERIC_DTYPES}


def fits(message: Message) -> bool:
    return message.error is None and message.top_n is None and all(
        isinstance(value, EncodedImage) and value.data or _dense_number(value) for value in message.tensors.values())


def carries(tensors: dict[str, Value]) -> bool:
    """Whether version 2 carries these values as rows of a batch: dense arrays of number dtypes."""
    return all(_dense_number(value) for value in tensors.values())


def _dense_number(value: Value) -> bool:
    return isinstance(value, np.ndarray) and value.dtype.char in _CHARS


def encode(message: Message) -> bytes:
    """One message that `fits`: its arrays as encode_rows writes a row, its images' bytes each
    behind their length."""
    spec, values = [], []
    for name, value in message.tensors.items():
        if isinstance(value, EncodedImage):
            spec.append((name, IMAGE_DTYPE, ()))
            values += (_IMAGE_LENGTH.pack(len(value.data)), value.data)
        else:
            array = _little_endian(value)
            spec.append((name, _CHARS[array.dtype.char], array.shape))
            values.append(memoryview(array.reshape(-1).view(np.uint8)))
    served = Served(message.batch_size, message.inference_us, message.model, message.model_version)
    return message_from_parts(message.uri, _layout_tail(tuple(spec), served), *values)


def encode_rows(uris: list[str], tensors: dict[str, np.ndarray], served: Served = Served()) -> list[bytes]:
    """One message per uri, holding row i of every stacked tensor (first dimension len(uris)),
    which `carries`: the rows share one layout and one copy of each tensor."""
    count = len(uris)
    arrays = [_little_endian(value) for value in tensors.values()]
    spec = tuple((name, _CHARS[array.dtype.char], array.shape[1:]) for name, array in zip(tensors, arrays))
    rows = [memoryview(array.reshape(-1).view(np.uint8)) for array in arrays]
    sizes = [array.nbytes // count if count else 0 for array in arrays]
    values = ([row[i * size:(i + 1) * size] for row, size in zip(rows, sizes)] for i in range(count))
    return _messages(uris, _layout_tail(spec, served), values)


def stacked_rows(tensors: dict[str, np.ndarray], served: Served = Served()) -> tuple[bytes, int, bytes | memoryview]:
    """The results of stacked tensors (first dimension: one row per result), which `carries`, as
    the JVM writes them: (the layout tail they share, a row's bytes, the rows one after another);
    message_from_parts(uri, tail, row i) is row i's message."""
    arrays = [_little_endian(value) for value in tensors.values()]
    count = len(arrays[0])
    spec = tuple((name, _CHARS[array.dtype.char], array.shape[1:]) for name, array in zip(tensors, arrays))
    columns = [array.reshape(count, -1).view(np.uint8) for array in arrays]
    rows = memoryview(columns[0]).cast("B") if len(columns) == 1 else np.concatenate(columns, axis=1).data
    return _layout_tail(spec, served), sum(column.shape[1] for column in columns), rows


def message_from_parts(uri: str, tail: bytes, *values: bytes | memoryview) -> bytes:
    """A message from its uri, its layout tail and its values' bytes."""
    key = uri.encode()
    return b"".join([_URI.pack(V2_MAGIC, len(key)), key, tail, *values])


def encode_alike(uris: list[str], requests: list[Mapping[str, Any]]) -> list[bytes] | None:
    """One message per uri from its request's arrays, when every request has the first one's
    names, and arrays of its little-endian number dtypes and shapes: they share one layout, and
    each array is copied once. None when they are not alike."""
    first = requests[0] if requests else {}
    kinds = [_number_kind(value) for value in first.values()]
    if not kinds or None in kinds:
        return None
    spec = tuple((name, value.dtype, value.shape) for name, value in first.items())
    values = []
    for request in requests:
        if len(request) != len(spec):
            return None
        parts = []
        for name, dtype, shape in spec:
            value = request.get(name)
            if type(value) is not np.ndarray or value.dtype != dtype or value.shape != shape:
                return None
            parts.append(value if value.flags.c_contiguous else value.tobytes())
        values.append(parts)
    layout_spec = tuple((name, kind, shape) for (name, _, shape), kind in zip(spec, kinds))
    return _messages(uris, _request_tail(layout_spec), values)


def encode_arrays(uri: str, request: Mapping[str, Any]) -> bytes | None:
    """One request's message as encode_alike writes it, when its inputs are all arrays of
    little-endian number dtypes (None otherwise): the path of a lone request, at 40% of
    encode_alike's cost for one."""
    spec, parts = [], []
    for name, value in request.items():
        kind = _number_kind(value)
        if kind is None:
            return None
        spec.append((name, kind, value.shape))
        parts.append(value if value.flags.c_contiguous else value.tobytes())
    return message_from_parts(uri, _request_tail(tuple(spec)), *parts) if spec else None


def _number_kind(value: Any) -> str | None:
    """The version 2 dtype name of an ndarray of a little-endian (or single-byte) number dtype;
    None for anything else."""
    return _LITTLE_ENDIAN.get(value.dtype) if type(value) is np.ndarray else None


def _messages(uris: list[str], layout_tail: bytes, values: Iterable[list[Any]]) -> list[bytes]:
    """Each uri's message: its header, the shared layout, then its values' bytes."""
    return [message_from_parts(uri, layout_tail, *parts) for uri, parts in zip(uris, values)]


def _little_endian(array: np.ndarray) -> np.ndarray:
    return np.asarray(array, array.dtype.newbyteorder("<"), order="C")


def _layout_tail(spec: tuple, served: Served) -> bytes:
    """The layout JSON of a tensor spec and what served it, behind its length. A result's served
    fields change with every batch (its time in serve), so only the spec's part is cached."""
    fields = "".join([f',"{key}":{_json_value(item)}' for key, item in zip(Served._fields, served) if item is not None])
    if not fields:
        return _request_tail(spec)
    text = f"{_tensors_json(spec)}{fields}}}".encode()
    return _LAYOUT_LENGTH.pack(len(text)) + text


@functools.lru_cache(maxsize=64)
def _tensors_json(spec: tuple) -> str:
    """The layout JSON of a tensor spec, open for more fields; cached, since a stream of messages
    repeats a few."""
    return json.dumps({"tensors": [[name, kind, list(shape)] for name, kind, shape in spec]}, separators=(",", ":"))[:-1]


@functools.lru_cache(maxsize=64)
def _request_tail(spec: tuple) -> bytes:
    """The layout tail of a request's tensor spec (nothing served yet)."""
    text = f"{_tensors_json(spec)}}}".encode()
    return _LAYOUT_LENGTH.pack(len(text)) + text


def _json_value(item: int | str) -> str:
    """A served field as JSON: an int as its digits, without the encoder; a model's name escaped."""
    return str(item) if type(item) is int else json.dumps(item)


def decode(payload: bytes) -> Message:
    try:
        _, uri_length = _URI.unpack_from(payload, 0)
        at = _URI.size + uri_length
        uri = str(payload[_URI.size:at], "utf-8")
        (layout_length,) = _LAYOUT_LENGTH.unpack_from(payload, at)
    except (struct.error, UnicodeDecodeError):
        raise DecodeError("not a cluster-serving message: a version 2 header cut short or not UTF-8") from None
    check_uri(uri)
    at += _LAYOUT_LENGTH.size
    if layout_length > MAX_LAYOUT_BYTES or at + layout_length > len(payload):
        raise DecodeError(f"version 2 layout of {layout_length} bytes does not fit the message")
    layout = bytes(payload[at:at + layout_length])
    tensors, needed, served = _parse_layout(layout)
    at += layout_length
    has_images = _holds_image(tensors)
    if needed != len(payload) - at and not (has_images and needed <= len(payload) - at):
        raise DecodeError(f"version 2 layout needs {needed} bytes of values, the message has {len(payload) - at}")
    values: dict[str, Value] = {}
    for name, dtype, shape, nbytes in tensors:
        if dtype is None:
            values[name], at = _image(name, payload, at)
            continue
        if at + nbytes > len(payload):  # after an image of the wrong length
            raise DecodeError(f"tensor {name!r}: {nbytes} bytes, the message has {len(payload) - at} left")
        values[name] = np.frombuffer(payload, dtype, math.prod(shape), at).reshape(shape)
        at += nbytes
    if at != len(payload):
        raise DecodeError(f"version 2 values end at byte {at} of a message of {len(payload)}")
    # Positional arguments (uri, tensors, error, error_code, batch_size, inference_us, top_n, model,
    # model_version, layout_key): a dataclass is built at less than half the cost of keywords. A
    # layout with images is no key: their pixels' shapes are known once they are decoded.
    batch_size, inference_us, model, model_version = served
    return Message(uri, values, None, None, batch_size, inference_us, None, model, model_version, None if has_images else layout)


def _image(name: str, payload: bytes, at: int) -> tuple[EncodedImage, int]:
    """The image whose length is at `at`, and where the values go on after it."""
    if at + _IMAGE_LENGTH.size > len(payload):
        raise DecodeError(f"image {name!r}: its length is cut short")
    (length,) = _IMAGE_LENGTH.unpack_from(payload, at)
    at += _IMAGE_LENGTH.size
    if not 0 < length <= len(payload) - at:
        raise DecodeError(f"image {name!r}: {length} bytes, the message has {len(payload) - at} left")
    return EncodedImage(bytes(payload[at:at + length])), at + length


def decode_stacked(layout: bytes, count: int, values: memoryview) -> tuple[dict[str, np.ndarray], Served]:
    """`count` requests of one layout whose values lie one after another in `values`, decoded
    together: each tensor stacked (row i is request i's, views of `values`, not copies), and what
    the layout says of how they were served. Refused as decode() refuses each of them."""
    if len(layout) > MAX_LAYOUT_BYTES:
        raise DecodeError(f"version 2 layout of {len(layout)} bytes does not fit the message")
    tensors, needed, served = _parse_layout(layout)
    if _holds_image(tensors):
        raise DecodeError("version 2 images do not stack: decode each message")
    if needed * count != len(values):
        raise DecodeError(f"version 2 layout needs {needed} bytes of values, the message has {len(values) // count}")
    if len(tensors) == 1:
        name, dtype, shape, _ = tensors[0]
        return {name: np.frombuffer(values, dtype).reshape(count, *shape)}, served
    block, at, stacked = np.frombuffer(values, np.uint8).reshape(count, needed), 0, {}
    for name, dtype, shape, nbytes in tensors:
        stacked[name] = block[:, at:at + nbytes].view(dtype).reshape(count, *shape)
        at += nbytes
    return stacked, served


def holds_images(layout: bytes) -> bool:
    """Whether messages of this layout hold images, which decode_stacked does not stack (False
    for a layout that does not parse: decode_stacked says why)."""
    try:
        tensors, _, _ = _parse_layout(layout)
    except DecodeError:
        return False
    return _holds_image(tensors)


def _holds_image(tensors: list[tuple[str, np.dtype | None, tuple[int, ...], int]]) -> bool:
    """Whether a parsed layout has an image among its tensors (dtype None)."""
    return any(dtype is None for _, dtype, _, _ in tensors)


@functools.lru_cache(maxsize=64)
def _parse_layout(text: bytes) -> tuple[list[tuple[str, np.dtype, tuple[int, ...], int]], int, Served]:
    """The checked layout: (name, dtype, shape, bytes) per tensor (an image: dtype None, shape (),
    its length's 4 bytes: at least that many), the bytes of all the values, and what a result says
    of how it was served.
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
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and isinstance(entry[1], str)
                and (entry[1] in NUMERIC_DTYPES or entry[1] == IMAGE_DTYPE and entry[2] == [])):
            raise DecodeError(f"version 2 tensor entry {str(entry)[:100]} is not [name, number dtype, shape] or [name, 'image', []]")
        if entry[1] == IMAGE_DTYPE:
            tensors.append((entry[0], None, (), _IMAGE_LENGTH.size))
            continue
        name, dtype = entry[0], np.dtype(entry[1]).newbyteorder("<")
        shape = parse_shape(name, json.dumps(entry[2]))
        tensors.append((name, dtype, shape, math.prod(shape) * dtype.itemsize))
    names = [name for name, *_ in tensors]
    if len(set(names)) != len(names):
        raise DecodeError("a tensor name appears more than once")
    needed = sum(nbytes for *_, nbytes in tensors)
    model = layout.get("model")
    served = Served(
        _layout_count(layout, "batch_size"), _layout_count(layout, "inference_us"),
        model if isinstance(model, str) else None, _layout_count(layout, "model_version"),
    )
    return tensors, needed, served


def _layout_count(layout: dict, key: str) -> int | None:
    item = layout.get(key)
    return item if isinstance(item, int) and not isinstance(item, bool) and 0 <= item < 2**63 else None
