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
- `oip`: `decode_request` of the Open Inference Protocol (JSON for an even first byte, protobuf
  for an odd one, the rest the record's value) raises anything but `DecodeError`, or accepts
  tensors that break the same bounds, or that do not survive encode_request -> decode_request.
- `batch`: `decode_records(records, LIMITS)`, then `prepare_instances` with PREPROCESS's images,
  raises anything at all, or loses count of a record (instances + rejected + dropped must equal
  the records in).

Strict mode (`STRICT = True`, `--strict` of fuzz_decoder.py, or FUZZ_STRICT=1): the job's stages
turn any exception into an error result (an escaped one would restart the job), which also hides
bugs. Then an InvalidInput from decode_image whose cause is not one of `EXPECTED_IMAGE_ERRORS`
(what Pillow raises on bad bytes: OSError, ValueError, SyntaxError, EOFError, struct.error, its
bomb error/warning) is reported, and the batch target also runs the decoder target on every
payload, since decode_records reports a decoder crash as a plain "bad request".
"""

from __future__ import annotations

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
from PIL import Image

from cluster_serving.config import ImageConfig, LimitsConfig, PreprocessConfig
from cluster_serving.runtime import preprocess
from cluster_serving.runtime.outcomes import InvalidInput
from cluster_serving.runtime.preprocess import decode_image
from cluster_serving.wire.codec import (
    MAX_TENSORS,
    MAX_URI_CHARS,
    DecodeError,
    EncodedImage,
    Message,
    SparseTensor,
    decode_message,
    encode_message,
)
from cluster_serving.wire.open_inference import decode_request, encode_request
from tests.fuzz.streams import build_stream

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

logging.getLogger("cluster_serving.runtime").setLevel(logging.CRITICAL)  # decode_records warns once per bad record


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
        return x.reshape(-1).tolist() == y.reshape(-1).tolist()
    return np.ascontiguousarray(x).tobytes() == np.ascontiguousarray(y).tobytes()


# --------------------------------------------------------------------------------------------
# message: structure-aware Arrow streams


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
    from cluster_serving.runtime.decode import (  # imports pyflink: only the batch target pays for it
        decode_records,
        prepare_instances,
    )

    records = unpack_records(data)
    if STRICT:
        for _, payload in records:
            check_decoder(payload or b"")
    with production_pillow(LIMITS.max_image_pixels):
        batch, dropped = decode_records(records, LIMITS)
        instances, refused = prepare_instances(batch.instances, PREPROCESS.images, LIMITS)
    rejected = batch.rejected + refused
    if len(instances) + len(rejected) + len(dropped) != len(records):
        raise FuzzBug(f"{len(records)} records in, {len(instances)} instances + "
                      f"{len(rejected)} rejected + {len(dropped)} dropped out")
    for message in rejected:
        if not message.error or not message.uri or len(message.uri) > MAX_URI_CHARS:
            raise FuzzBug(f"rejected record without an error or a usable uri: {message!r}")
    for message in instances:
        for name, value in message.tensors.items():
            if not isinstance(value, np.ndarray):
                raise FuzzBug(f"instance {message.uri!r}: {name!r} prepared to a {type(value).__name__}")


# --------------------------------------------------------------------------------------------
# oip: the Open Inference Protocol's JSON and protobuf requests


def check_oip(data: bytes) -> None:
    if not data:
        return
    encoding = "json" if data[0] % 2 == 0 else "protobuf"
    payload = data[1:]
    try:
        message, request = decode_request(payload, encoding, "key", MAX_BYTES)
    except DecodeError:
        return
    if message.uri != "key" or request.id != "key" or len(message.tensors) > MAX_TENSORS:
        raise FuzzBug(f"accepted uri {message.uri[:40]!r}, id {request.id[:40]!r}, {len(message.tensors)} tensors")
    decoded = sum(_check_value(name, value, MAX_BYTES) for name, value in message.tensors.items())
    bound = AMPLIFICATION * max(len(payload), 1024)
    if decoded > bound:
        raise FuzzBug(f"{len(payload)} bytes on the wire decoded to {decoded} bytes (over {bound})")
    try:
        again, _ = decode_request(encode_request(encoding, "key", message.tensors), encoding, "key", 1 << 62)
    except ValueError as exc:  # DecodeError is a ValueError
        raise FuzzBug(f"an accepted request does not survive encode -> decode: {exc!r}") from exc
    if not same_message(message, again):
        raise FuzzBug(f"encode -> decode changed the request: {message!r} -> {again!r}")


TARGETS = {
    "decoder": check_decoder,
    "message": check_structured,
    "image": check_image,
    "batch": check_batch,
    "oip": check_oip,
}
