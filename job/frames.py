"""How a micro-batch crosses between the JVM and the Python operator: one bytes object per batch.

The JVM batches requests (job/java/MicroBatchOperator.java) and hands Python one frame per batch;
Python answers with one frame of results, split again into Kafka records in the JVM
(SplitResults.java). A Python call per batch instead of per request is most of the job's speed.
Layout (BatchFrames.java writes and reads the same): little-endian uint32 count, then per record a
uint32 uri length (0xFFFFFFFF: a record without a key), the uri in UTF-8, a uint32 payload length
and the payload.
"""

from __future__ import annotations

import struct
from typing import Iterable

_U32 = struct.Struct("<I")
NO_URI = 0xFFFFFFFF


class FrameError(ValueError):
    """The frame is cut short or its lengths do not add up: a bug on the JVM side, not bad input."""


def read_frame(frame: bytes) -> list[tuple[str | None, memoryview]]:
    """The (uri, payload) records of a frame; payloads are views of the frame, not copies."""
    view = memoryview(frame)
    (count,), at = _U32.unpack_from(frame, 0), 4
    records = []
    for _ in range(count):
        (length,) = _U32.unpack_from(frame, at)
        at += 4
        uri = None
        if length != NO_URI:
            uri = str(view[at:at + length], "utf-8")
            at += length
        (length,) = _U32.unpack_from(frame, at)
        at += 4
        records.append((uri, view[at:at + length]))
        at += length
    if at != len(frame):
        raise FrameError(f"a frame of {count} records ends at byte {at}, not {len(frame)}")
    return records


def write_frame(records: Iterable[tuple[str, bytes]]) -> bytes:
    """The frame of (uri, payload) records."""
    parts = [b""]
    for uri, payload in records:
        key = uri.encode()
        parts += (_U32.pack(len(key)), key, _U32.pack(len(payload)), payload)
    parts[0] = _U32.pack((len(parts) - 1) // 4)
    return b"".join(parts)
