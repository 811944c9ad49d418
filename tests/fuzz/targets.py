"""The fuzz targets: plain functions of one input (bytes) that raise on a bug and return otherwise.

They import neither atheris nor pytest: `fuzz_decoder.py` runs them under atheris (coverage
guided), `tests/test_fuzz.py` replays the seed corpus through them in-process. What counts as a bug:

- `decoder`: `decode_message(payload, MAX_BYTES)` raises anything but `DecodeError`, or accepts a
  message that breaks the codec's own promises (a uri within limits, tensors whose size fills
  their shape, a sparse tensor that passes its check, at most `AMPLIFICATION` times `MAX_BYTES`
  of decoded data), or one that does not survive encode -> decode unchanged.
- `message`: the same checks, on Arrow streams built from the input by `build_stream` (fuzzed
  schema metadata, column types, list offsets, nulls, several batches, LZ4/ZSTD compression),
  which reaches the codec's checks that raw-byte mutation of the IPC framing rarely gets past.
- `image`: `decode_image(name, data, config, MAX_PIXELS)` for each of `IMAGE_CONFIGS` raises
  anything but `InvalidInput`, returns an array of the wrong type, layout or size, or makes the
  process's peak RSS grow by more than `IMAGE_RSS_GROWTH_MB` (PIL allocates with malloc, which
  tracemalloc does not see; a pixel bomb that slips past `MAX_PIXELS` shows up here). Pillow is
  configured as the decode stage configures it (`production_pillow`).
- `batch`: `decode_records(records, LIMITS, PREPROCESS)` raises anything at all, or loses count of
  a record (instances + rejected + dropped must equal the records in).

Strict mode (`STRICT = True`, `--strict` of fuzz_decoder.py, or FUZZ_STRICT=1): the job's stages
turn any exception into an error result (an escaped one would restart the job), which also hides
bugs. Then an InvalidInput from decode_image whose cause is not one of `EXPECTED_IMAGE_ERRORS`
(what Pillow raises on bad bytes: OSError, ValueError, SyntaxError, EOFError, struct.error, its
bomb error/warning) is reported, and the batch target also runs the decoder target on every
payload, since decode_records reports a decoder crash as a plain "bad request".
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import struct
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pyarrow as pa

from conf import ImageConfig, LimitsConfig, PreprocessConfig
from connectors.codec import (
    MAX_TENSORS,
    MAX_URI_CHARS,
    DecodeError,
    EncodedImage,
    Message,
    SparseTensor,
    decode_message,
    encode_message,
)
from job import preprocess
from job.model import InvalidInput
from job.preprocess import decode_image
from PIL import Image

# Small limits: a bomb shows up as a bound broken, not as minutes of swapping.
MAX_BYTES = 1 << 20
MAX_PIXELS = 4096
# Decoded bytes per wire byte: booleans travel as bits and come out as bytes (8x); past that
# the message is a decompression bomb.
AMPLIFICATION = 8
IMAGE_RSS_GROWTH_MB = 64
STRICT = os.environ.get("FUZZ_STRICT", "") not in ("", "0")
EXPECTED_IMAGE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, struct.error,
                         Image.DecompressionBombError, Image.DecompressionBombWarning)

IMAGE_CONFIGS = (
    ImageConfig(),
    ImageConfig(resize=(16, 12), layout="CHW", dtype="float32", scale=1 / 255,
                mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)),
    ImageConfig(channels="L", dtype="float16"),
)
# In a batch, an input named "image" is decoded as the second config, any other as the default.
IMAGE_INPUT = "image"
LIMITS = LimitsConfig(max_instance_bytes=MAX_BYTES, max_image_pixels=MAX_PIXELS)
PREPROCESS = PreprocessConfig(images={IMAGE_INPUT: IMAGE_CONFIGS[1]})

logging.getLogger("job").setLevel(logging.CRITICAL)  # decode_records warns once per bad record


class FuzzBug(AssertionError):
    """An input broke a promise without raising (a bound, an invariant, a round trip)."""


# --------------------------------------------------------------------------------------------
# decoder


def check_decoder(payload: bytes, max_bytes: int = MAX_BYTES) -> Message | None:
    """Decodes; a DecodeError is a correct answer, any other exception a bug. Returns the message."""
    try:
        message = decode_message(payload, max_bytes)
    except DecodeError:
        return None
    check_message(message, payload, max_bytes)
    return message


def check_message(message: Message, payload: bytes, max_bytes: int) -> None:
    if not message.uri or len(message.uri) > MAX_URI_CHARS:
        raise FuzzBug(f"accepted a uri of {len(message.uri)} characters")
    if len(message.tensors) > MAX_TENSORS:
        raise FuzzBug(f"accepted {len(message.tensors)} tensors")
    decoded = 0
    for name, value in message.tensors.items():
        decoded += _check_value(name, value, max_bytes)
    bound = AMPLIFICATION * max(len(payload), 1024)
    if decoded > bound:
        raise FuzzBug(f"{len(payload)} bytes on the wire decoded to {decoded} bytes (over {bound})")
    try:
        again = decode_message(encode_message(message), max_bytes=1 << 62)
    except (ValueError, pa.ArrowException) as exc:  # DecodeError is a ValueError
        raise FuzzBug(f"an accepted message does not survive encode -> decode: {exc!r}") from exc
    if not same_message(message, again):
        raise FuzzBug(f"encode -> decode changed the message: {message!r} -> {again!r}")


def _check_value(name: str, value: object, max_bytes: int) -> int:
    """The value's decoded size in bytes; raises FuzzBug if it is not what the codec promises."""
    if isinstance(value, EncodedImage):
        if not isinstance(value.data, bytes) or not value.data:
            raise FuzzBug(f"image {name!r}: accepted an empty or non-bytes image")
        return len(value.data)
    if isinstance(value, SparseTensor):
        try:
            value.check(max_dense_bytes=max_bytes)
        except ValueError as exc:
            raise FuzzBug(f"sparse {name!r} accepted but fails its own check: {exc}") from None
        dense = value.to_dense()  # what preprocess does; bounded by max_bytes just above
        if dense.shape != value.shape:
            raise FuzzBug(f"sparse {name!r}: dense shape {dense.shape} != {value.shape}")
        return value.indices.nbytes + value.values.nbytes
    if not isinstance(value, np.ndarray):
        raise FuzzBug(f"tensor {name!r}: decoded to a {type(value).__name__}")
    if value.size != math.prod(value.shape):
        raise FuzzBug(f"tensor {name!r}: size {value.size} does not fill {value.shape}")
    if value.dtype == object:
        if not all(isinstance(item, str) for item in value.ravel()):
            raise FuzzBug(f"tensor {name!r}: a str tensor holds non-str items")
        return value.size * 8 + sum(len(item) for item in value.ravel())
    return value.nbytes


def same_message(a: Message, b: Message) -> bool:
    if (a.uri, a.error, a.batch_size, a.inference_us, a.top_n) != (b.uri, b.error, b.batch_size, b.inference_us, b.top_n):
        return False
    if list(a.tensors) != list(b.tensors):
        return False
    return all(_same_value(a.tensors[name], b.tensors[name]) for name in a.tensors)


def _same_value(x: object, y: object) -> bool:
    if type(x) is not type(y):
        return False
    if isinstance(x, EncodedImage):
        return x.data == y.data
    if isinstance(x, SparseTensor):
        return x.shape == y.shape and _same_array(x.indices, y.indices) and _same_array(x.values, y.values)
    return _same_array(x, y)


def _same_array(x: np.ndarray, y: np.ndarray) -> bool:
    # Bytewise, so that NaN payloads and -0.0 count as the same value only when they are.
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    if x.dtype == object:
        return x.tolist() == y.tolist()
    return np.ascontiguousarray(x).tobytes() == np.ascontiguousarray(y).tobytes()


# --------------------------------------------------------------------------------------------
# message: structure-aware Arrow streams


class Reader:
    """Reads choices off the fuzz input, front to back; past its end every read gives 0 / empty.

    A tiny FuzzedDataProvider that needs no atheris, so pytest can replay the same inputs."""

    def __init__(self, data: bytes):
        self.data = data
        self.pos = 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            return 0
        self.pos += 1
        return self.data[self.pos - 1]

    def pick(self, options: list | tuple):
        return options[self.byte() % len(options)]

    def int_in(self, low: int, high: int) -> int:
        span = high - low + 1
        value = int.from_bytes(bytes(self.byte() for _ in range(4 if span > 65536 else 2)), "little")
        return low + value % span

    def take(self, n: int) -> bytes:
        out = self.data[self.pos:self.pos + n]
        self.pos += len(out)
        return out

    def text(self, max_len: int) -> str:
        return self.take(self.int_in(0, max_len)).decode("utf-8", errors="replace")


NUMERIC = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
           "float16", "float32", "float64")
DTYPE_NAMES = (*NUMERIC, "str", "image", "object", "float128", "complex64", "", "<f4", "O", "S1", "V8")
LAYOUTS = (None, "coo", "COO", "csr", "")
COMPRESSION = (None, None, "lz4", "zstd")
URIS = ("u", "req-1", "", "x" * MAX_URI_CHARS, "x" * (MAX_URI_CHARS + 1), "\udcff", "é" * 600)


def _arrow_values(r: Reader, kind: str, count: int) -> pa.Array:
    """`count` values of the Arrow type that `kind` says, some of them maybe null."""
    nulls = r.byte() % 8 == 0
    mask = np.array([r.byte() % 4 == 0 for _ in range(count)], bool) if nulls and count else None
    if kind == "str":
        values = pa.array([r.text(8) for _ in range(count)], pa.large_string(), mask=mask)
    elif kind in ("binary", "image"):
        values = pa.array([r.take(r.int_in(0, 64)) for _ in range(count)], pa.large_binary(), mask=mask)
    elif kind == "string":  # not large: a type the codec must refuse
        values = pa.array([r.text(4) for _ in range(count)], pa.string(), mask=mask)
    else:
        dtype = np.dtype(kind)
        raw = r.take(count * dtype.itemsize).ljust(count * dtype.itemsize, b"\0")
        array = np.frombuffer(raw, dtype=dtype) if kind != "bool" else np.frombuffer(raw, np.uint8) % 2 == 1
        values = pa.array(array, mask=mask)
    return values


def _column(r: Reader, rows: int) -> tuple[pa.Array, dict[str, str]]:
    """A column of `rows` rows and the field metadata that would describe it honestly: mostly a
    large_list<T> dense tensor, else a sparse struct, an image, or a type the codec must refuse."""
    kind = r.byte() % 16
    if kind == 0:  # a flat column
        return _arrow_values(r, r.pick(NUMERIC), rows), {"cs.dtype": "float32", "cs.shape": "[1]"}
    if kind in (1, 2, 3):  # a COO sparse tensor
        return _sparse_column(r, rows)
    if kind == 4:  # an encoded image
        column, _ = _list_column(r, rows, "image")
        return column, {"cs.dtype": "image", "cs.shape": "[]"}
    element = r.pick((*NUMERIC, "str", "str", "binary", "string"))
    column, count = _list_column(r, rows, element)
    if kind == 5:  # a list<T> instead of large_list<T>
        column = pa.ListArray.from_arrays(pa.array(column.offsets.to_numpy().astype(np.int32)), column.values)
    return column, {"cs.dtype": element, "cs.shape": json.dumps(_factor(r, count))}


def _factor(r: Reader, count: int) -> list[int]:
    """A shape with `count` elements: [count], [1, count], [a, b] or [] for a scalar."""
    choice = r.byte() % 4
    if choice == 0 and count == 1:
        return []
    if choice == 1:
        return [1, count]
    if choice == 2 and count:
        first = next(d for d in range(2, count + 1) if count % d == 0) if count > 1 else 1
        return [first, count // first]
    return [count]


def _sparse_column(r: Reader, rows: int) -> tuple[pa.Array, dict[str, str]]:
    rank, nnz, dim = r.int_in(0, 3), r.int_in(0, 6), r.int_in(1, 8)
    element = r.pick(NUMERIC)
    index_values = [[r.byte() % (dim + 1) for _ in range(rank * nnz)] for _ in range(rows)]
    indices = pa.LargeListArray.from_arrays(
        pa.array(np.cumsum([0, *map(len, index_values)]).astype(np.int64)),
        pa.array([i for row in index_values for i in row], pa.int64()))
    values = _arrow_values(r, element, nnz * rows)
    values = pa.LargeListArray.from_arrays(pa.array(np.arange(rows + 1, dtype=np.int64) * nnz), values)
    names = r.pick((["indices", "values"], ["indices", "values"], ["indices", "values"], ["values", "indices"], ["i", "v"]))
    column = pa.StructArray.from_arrays([indices, values], names=names)
    return column, {"cs.dtype": element, "cs.shape": json.dumps([dim] * rank), "cs.layout": "coo"}


def _list_column(r: Reader, rows: int, element: str) -> tuple[pa.Array, int]:
    """A large_list column of `rows` rows over values that may reach past them (nonzero offsets);
    also returns the first row's length."""
    lengths = [r.int_in(0, 40) for _ in range(rows)]
    lead, tail = r.byte() % 4, r.byte() % 4
    values = _arrow_values(r, element, lead + sum(lengths) + tail)
    offsets = np.cumsum([lead, *lengths]).astype(np.int64)
    column = pa.LargeListArray.from_arrays(pa.array(offsets), values)
    if r.byte() % 6 == 0 and rows:  # a slice: the column itself has an offset
        padded = pa.LargeListArray.from_arrays(pa.array(np.concatenate([[0], offsets])), values)
        column = padded.slice(1, rows)
    return column, lengths[0] if lengths else 0


def _metadata_value(r: Reader, options: tuple) -> str | None:
    """Mostly options[0] (the usual value, or None: absent), else another option, absent, or text."""
    choice = r.byte()
    if choice < 160:
        return options[0]
    choice %= len(options) + 1
    if choice < len(options):
        return options[choice]
    return None if choice % 2 else r.text(16)


SHAPES = ("[]", "", "null", "{}", "[1.5]", "[true]", "[-1]", "[2147483648]", "[[1]]", '["1"]',
          "[" + ",".join(["1"] * 17) + "]", "[1e3]", "[0]", "[NaN]", "[2147483647,2147483647]")


def build_stream(data: bytes) -> bytes:
    """An Arrow IPC stream whose schema, metadata, columns and framing the input chooses."""
    r = Reader(data)
    meta: dict[str, str] = {}
    for key, options in (
        ("cs.version", ("1", "2", "", "01")),
        ("cs.uri", URIS),
        ("cs.error", (None, "boom", "")),
        ("cs.batch_size", (None, "3", "-1", "1" * 19, "٣", "²", "")),
        ("cs.inference_us", (None, "12", "x")),
        ("cs.top_n", (None, "5", "0")),
    ):
        value = _metadata_value(r, options)
        if value is not None:
            meta[key] = value
    rows = r.pick((1, 1, 1, 1, 1, 1, 0, 2))
    fields, columns = [], []
    for _ in range(r.pick((1, 1, 2, 3, 0))):
        column, honest = _column(r, rows)
        field_meta = {}
        for key, options in (("cs.dtype", DTYPE_NAMES), ("cs.shape", SHAPES), ("cs.layout", LAYOUTS)):
            value = _metadata_value(r, (honest.get(key), *options))  # mostly the honest value
            if value is not None:
                field_meta[key] = value
        fields.append(pa.field(r.pick(("x", "y", "image", "x", r.text(4))), column.type, metadata=field_meta))
        columns.append(column)
    schema = pa.schema(fields, metadata={k: v.encode("utf-8", "surrogatepass") for k, v in meta.items()})
    batch = pa.record_batch(columns, schema=schema) if columns else pa.record_batch([], schema=schema)
    options = pa.ipc.IpcWriteOptions(compression=r.pick(COMPRESSION))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema, options=options) as writer:
        for _ in range(r.pick((1, 1, 1, 1, 1, 1, 0, 2))):
            writer.write_batch(batch)
    stream = sink.getvalue().to_pybytes()
    damage = r.byte() % 16
    if damage == 1 and stream:  # flip one byte
        at = r.int_in(0, len(stream) - 1)
        stream = stream[:at] + bytes([stream[at] ^ (r.byte() or 1)]) + stream[at + 1:]
    elif damage == 2:  # truncate
        stream = stream[: r.int_in(0, len(stream))]
    return stream


def check_structured(data: bytes) -> Message | None:
    try:
        stream = build_stream(data)
    except (pa.ArrowException, ValueError, TypeError, UnicodeError, OverflowError):
        return None  # the input described something Arrow itself will not build: not a codec bug
    return check_decoder(stream)


# --------------------------------------------------------------------------------------------
# image

_rss_peak_mb = 0


@contextmanager
def production_pillow(max_pixels: int) -> Iterator[None]:
    """Pillow's process-wide settings as the decode stage makes them when it opens
    (preprocess.configure_pillow: its pixel limit ours, its bomb warning an error), put back after,
    so that replaying the corpus inside pytest leaves other tests' Pillow as it was."""
    configure = getattr(preprocess, "configure_pillow", None)
    saved = Image.MAX_IMAGE_PIXELS
    with warnings.catch_warnings():
        try:
            if configure is not None:
                configure(max_pixels)
            yield
        finally:
            Image.MAX_IMAGE_PIXELS = saved


def _peak_rss_mb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024  # kB on Linux


def check_image(data: bytes, max_pixels: int = MAX_PIXELS) -> None:
    """decode_image with each config: InvalidInput or a well-formed array within the bounds."""
    global _rss_peak_mb
    before = _rss_peak_mb or _peak_rss_mb()
    for config in IMAGE_CONFIGS:
        try:
            with production_pillow(max_pixels):
                array = decode_image("image", data, config, max_pixels)
        except InvalidInput as exc:
            cause = exc.__cause__ or exc.__context__  # kept by `raise ... from None`, only hidden
            if STRICT and cause is not None and not isinstance(cause, (InvalidInput, *EXPECTED_IMAGE_ERRORS)):
                raise FuzzBug(f"decode_image turned an unexpected {type(cause).__name__} into "
                              f"InvalidInput: {exc}") from cause
            continue
        _check_image_array(array, config, max_pixels)
    _rss_peak_mb = _peak_rss_mb()
    if _rss_peak_mb - before > IMAGE_RSS_GROWTH_MB:
        raise FuzzBug(f"peak RSS grew by {_rss_peak_mb - before} MB decoding {len(data)} bytes "
                      f"(limit {IMAGE_RSS_GROWTH_MB} MB at max_pixels={max_pixels})")


def _check_image_array(array: np.ndarray, config: ImageConfig, max_pixels: int) -> None:
    if not isinstance(array, np.ndarray) or array.ndim != 3 or not array.flags.c_contiguous:
        raise FuzzBug(f"decode_image returned {type(array).__name__} {getattr(array, 'shape', None)}")
    if array.dtype != np.dtype(config.dtype):
        raise FuzzBug(f"decode_image returned {array.dtype}, config says {config.dtype}")
    channels = 1 if config.channels == "L" else 3
    height, width, depth = array.shape if config.layout == "HWC" else (array.shape[1], array.shape[2], array.shape[0])
    if depth != channels:
        raise FuzzBug(f"decode_image returned {depth} channels, config says {config.channels}")
    if config.resize is not None and (height, width) != tuple(config.resize):
        raise FuzzBug(f"decode_image returned {height}x{width}, config says resize to {config.resize}")
    if config.resize is None and height * width > max_pixels:
        raise FuzzBug(f"decode_image returned {height}x{width} pixels, over max_pixels={max_pixels}")


# --------------------------------------------------------------------------------------------
# batch

# Record framing of a batch input: per record one mode byte, then for a payload a 3-byte
# big-endian length and the bytes; mode bit 0x80: the payload is None. Key by mode % 6:
KEY_NONE, KEY_URI, KEY_EMPTY, KEY_TEXT, KEY_LONG, KEY_OTHER = range(6)
MAX_RECORDS = 8


def pack_records(records: list[tuple[int, bytes | None]]) -> bytes:
    """The batch input for (mode, payload) records; KEY_TEXT takes its key from the payload's
    first byte's worth of text, see unpack_records."""
    out = bytearray()
    for mode, payload in records:
        if payload is None:
            out.append(mode | 0x80)
        else:
            out.append(mode & 0x7F)
            out += len(payload).to_bytes(3, "big") + payload
    return bytes(out)


def unpack_records(data: bytes) -> list[tuple[str | None, bytes | None]]:
    records: list[tuple[str | None, bytes | None]] = []
    pos = 0
    while pos < len(data) and len(records) < MAX_RECORDS:
        mode = data[pos]
        pos += 1
        payload = None
        if not mode & 0x80:
            (length,) = struct.unpack(">I", b"\0" + data[pos:pos + 3].rjust(3, b"\0"))
            payload = data[pos + 3:pos + 3 + length]
            pos += 3 + length
        records.append((_key(mode & 0x7F, payload), payload))
    return records


def _key(mode: int, payload: bytes | None) -> str | None:
    kind = mode % 6
    if kind == KEY_NONE:
        return None
    if kind == KEY_URI:  # the key a well-behaved producer sends: the payload's uri
        try:
            return decode_message(payload or b"", 1 << 62).uri
        except Exception:  # noqa: BLE001 - the decoder target reports those; here any key will do
            return "u"
    if kind == KEY_EMPTY:
        return ""
    if kind == KEY_TEXT:
        return (payload or b"")[: mode // 6].decode("utf-8", errors="replace")
    if kind == KEY_LONG:
        return "k" * (MAX_URI_CHARS + 1)
    return "other-uri"


def check_batch(data: bytes) -> None:
    from job.decode import decode_records  # imports pyflink: only the batch target pays for it

    records = unpack_records(data)
    if STRICT:
        for _, payload in records:
            check_decoder(payload or b"")
    with production_pillow(LIMITS.max_image_pixels):
        batch, dropped = decode_records(records, LIMITS, PREPROCESS)
    if len(batch.instances) + len(batch.rejected) + dropped != len(records):
        raise FuzzBug(f"{len(records)} records in, {len(batch.instances)} instances + "
                      f"{len(batch.rejected)} rejected + {dropped} dropped out")
    for message in batch.rejected:
        if not message.error or not message.uri or len(message.uri) > MAX_URI_CHARS:
            raise FuzzBug(f"rejected record without an error or a usable uri: {message!r}")
    for message in batch.instances:
        for name, value in message.tensors.items():
            if not isinstance(value, np.ndarray):
                raise FuzzBug(f"instance {message.uri!r}: {name!r} prepared to a {type(value).__name__}")


TARGETS = {
    "decoder": check_decoder,
    "message": check_structured,
    "image": check_image,
    "batch": check_batch,
}
