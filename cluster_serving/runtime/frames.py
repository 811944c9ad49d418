"""How a micro-batch crosses between the JVM and the Python operator: one bytes object per batch.

The JVM batches requests (cluster_serving/jvm/java/MicroBatchOperator.java) and hands Python one frame per batch;
Python answers with one frame of results, split again into Kafka records in the JVM
(SplitResults.java). A Python call per batch instead of per request is most of the job's speed.
Layout (BatchFrames.java writes and reads the same), little-endian. The record part: a uint32
count, then per record a uint32 uri length (0xFFFFFFFF: a record without a key), the uri in UTF-8,
a uint32 payload length and the payload. A frame to Python starts with a header, a uint32 length
and that many UTF-8 bytes: "B" + model + TAB + version for a batch of one route (the requests'
`model` and `version` headers, "" when absent), or "C" + the routing table text for a control
frame (no records; the batches after it were made by that table). A results frame back is the
record part alone.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterable

_U32 = struct.Struct("<I")
NO_URI = 0xFFFFFFFF
BATCH = "batch"
CONTROL = "control"
_KINDS = {"B": BATCH, "C": CONTROL}

Record = tuple[str | None, memoryview]


class FrameError(ValueError):
    """The frame is cut short or its lengths do not add up: a bug on the JVM side, not bad input."""


@dataclass(frozen=True)
class Frame:
    """One frame from the batcher. kind BATCH: the requests of one route, model and version as
    their headers said ("" when absent), table None. kind CONTROL: `table` is the routing table
    text (cluster_serving/runtime/repository.py RoutingTable.parse), model and version "", no records."""

    kind: str
    model: str
    version: str
    table: str | None
    records: list[Record]

    @property
    def is_control(self) -> bool:
        return self.kind == CONTROL


def read_frame(frame: bytes) -> Frame:
    """The header and the (uri, payload) records of a frame; payloads are views of the frame, not copies."""
    view = memoryview(frame)
    try:
        (length,) = _U32.unpack_from(frame, 0)
        if 4 + length > len(frame):
            raise FrameError(f"a frame header of {length} bytes does not fit a frame of {len(frame)}")
        header = str(view[4:4 + length], "utf-8")
        records = _read_records(frame, view, 4 + length)
    except (struct.error, UnicodeDecodeError) as exc:
        raise FrameError(f"a frame of {len(frame)} bytes does not parse: {exc}") from None
    kind = _KINDS.get(header[:1])
    if kind is None:
        raise FrameError(f"a frame header starts with {header[:1]!r}, not 'B' or 'C'")
    if kind == CONTROL:
        if records:
            raise FrameError(f"a control frame carries {len(records)} records")
        return Frame(CONTROL, "", "", header[1:], records)
    # Names and versions never hold a tab; a header value that does (a client's mistake) puts the
    # split at the last tab, and the request gets an error result either way.
    model, tab, version = header[1:].rpartition("\t")
    if not tab:
        raise FrameError(f"a batch frame header has no tab: {header[:80]!r}")
    return Frame(BATCH, model, version, None, records)


def _read_records(frame: bytes, view: memoryview, at: int) -> list[Record]:
    (count,) = _U32.unpack_from(frame, at)
    at, size = at + 4, len(frame)
    records = []
    for _ in range(count):
        (length,) = _U32.unpack_from(frame, at)
        at += 4
        uri = None
        if length != NO_URI:
            if at + length > size:
                raise FrameError(f"a uri of {length} bytes at byte {at} runs past a frame of {size}")
            uri = str(view[at:at + length], "utf-8")
            at += length
        (length,) = _U32.unpack_from(frame, at)
        at += 4
        if at + length > size:
            raise FrameError(f"a payload of {length} bytes at byte {at} runs past a frame of {size}")
        records.append((uri, view[at:at + length]))
        at += length
    if at != size:
        raise FrameError(f"a frame of {count} records ends at byte {at}, not {size}")
    return records


def write_frame(records: Iterable[tuple[str, bytes]]) -> bytes:
    """The frame of (uri, payload) records (results: no header)."""
    parts = [b""]
    for uri, payload in records:
        key = uri.encode()
        parts += (_U32.pack(len(key)), key, _U32.pack(len(payload)), payload)
    parts[0] = _U32.pack((len(parts) - 1) // 4)
    return b"".join(parts)


def read_result_frame(frame: bytes) -> list[Record]:
    """The (uri, result payload) records of a results frame (for tests and tools; the JVM splits
    these into Kafka records)."""
    return _read_records(frame, memoryview(frame), 0)


def write_batch_frame(model: str, version: str, records: Iterable[tuple[str | None, bytes]]) -> bytes:
    """A batch frame as the JVM writes it (for tests and tools; the job reads these, never writes them)."""
    return _with_header("B" + model + "\t" + version, records)


def write_control_frame(table: str) -> bytes:
    """A control frame as the JVM writes it (for tests and tools)."""
    return _with_header("C" + table, ())


def _with_header(header: str, records: Iterable[tuple[str | None, bytes]]) -> bytes:
    encoded = header.encode()
    parts = [_U32.pack(len(encoded)), encoded, b""]
    for uri, payload in records:
        key = None if uri is None else uri.encode()
        parts += (_U32.pack(NO_URI if key is None else len(key)), key or b"", _U32.pack(len(payload)), payload)
    parts[2] = _U32.pack((len(parts) - 3) // 4)
    return b"".join(parts)
