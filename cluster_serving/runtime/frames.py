"""How a micro-batch crosses between the JVM and the Python operator: one bytes object per batch.

The JVM batches requests (cluster_serving/jvm/java/MicroBatchOperator.java) and hands Python one frame per batch;
Python answers with one frame of results, split again into Kafka records in the JVM
(SplitResults.java). A Python call per batch instead of per request is most of the job's speed.
Layout (BatchFrames.java writes and reads the same), little-endian. The record part: a uint32
count, then per record a uint32 uri length (0xFFFFFFFF: a record without a key), the uri in UTF-8,
a uint32 payload length and the payload. A frame to Python starts with a header, a uint32 length
and that many UTF-8 bytes: "B" + model + TAB + version for a batch of one route (the requests'
`model` and `version` headers, "" when absent), then its record part and its sources block; or
"C" + the routing table text for a control frame (no records; the batches after it were made by
that table); "P" for a poll frame (no records: what the Python stage finished since, please)
and "D" for a drain frame (no records: wait for every batch held, as at the end of the input;
runtime/scheduler.py). The sources block says where each request was read, for its dead letter: per request
an int32 partition and an int64 offset (-1: not known), and its other headers (a uint32 length,
0xFFFFFFFF for none, and a header block: a uint32 count, then per header a uint32 name length, the
UTF-8 name, a uint32 value length, 0xFFFFFFFF for none, and the value; HeaderBlock.java).

A batch of alike requests (format 2 messages of one layout, each under its uri as the record key,
no headers but the route's: what a client sending one model's tensors writes) comes as "A" +
model + TAB + version, taken apart by the JVM so that Python reads it without a step per request: a
uint32 count, the layout (uint32 length, bytes), a uint32 value size, the uris block (uint32 byte
length, then per request a uint32 length and the uri), the values block (value size bytes per
request, one after another) and the sources block.

Request frames ("A" and "B") are numbered in the order they are sent, from 0 for each run of the
task: a results frame back starts with the numbers of the batches it answers (a uint32 count, then
an int64 each), so that the JVM knows which batches the Python stage still holds (it polls while
there are, and keeps their requests in its checkpoints), then a record part, the dead letters (a uint32 count, then per dead letter a
record as in the record part and its headers: a uint32 length and a header block), then any number
of alike sections, one per stacked run (`AlikeResults`): a uint32 count, the layout tail the results
share (format 2's: uint32 length, JSON), a uint32 row size, a uris block and the rows block; the
JVM writes each row's message.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TypeVar

from cluster_serving.wire.codec import message_from_parts

_U32 = struct.Struct("<I")
_SOURCE = struct.Struct("<iqI")
NO_URI = 0xFFFFFFFF
BATCH = "batch"
ALIKE = "alike"
CONTROL = "control"
POLL = "poll"
DRAIN = "drain"
_KINDS = {"B": BATCH, "A": ALIKE, "C": CONTROL, "P": POLL, "D": DRAIN}

Record = tuple[str | None, memoryview]
T = TypeVar("T")
Headers = list[tuple[str, bytes | None]]


@dataclass(frozen=True)
class Source:
    """Where a request was read (-1: not known), and its headers other than the route's, as a
    header block (None: none)."""

    partition: int = -1
    offset: int = -1
    headers: bytes | None = None


class _LazyBlock(Sequence[T]):
    """A block of `count` items of a frame, read only when first asked for; `_read` reads them
    from the block's bytes and says where they end, which must be the block's end."""

    kind = "block"

    def __init__(self, block: bytes | memoryview, count: int):
        self.block = block
        self.count = count

    def _read(self, view: memoryview) -> tuple[list[T], int]:
        raise NotImplementedError

    @cached_property
    def _items(self) -> list[T]:
        view = memoryview(self.block)
        items, at = self._read(view)
        if at != len(view):
            raise FrameError(f"a {self.kind} block of {self.count} ends at byte {at}, not {len(view)}")
        return items

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index):  # type: ignore[override]
        return self._items[index]

    def __iter__(self) -> Iterator[T]:
        return iter(self._items)


class SourceBlock(_LazyBlock[Source]):
    """The sources block of a frame's requests: an alike batch needs it only for a dead letter."""

    kind = "sources"

    def _read(self, view: memoryview) -> tuple[list[Source], int]:
        sources, at = [], 0
        for _ in range(self.count):
            partition, offset, length = _SOURCE.unpack_from(view, at)
            at += _SOURCE.size
            headers = None
            if length != NO_URI:
                headers, at = bytes(view[at:at + length]), at + length
            sources.append(Source(partition, offset, headers))
        return sources, at


def read_headers(block: bytes) -> Headers:
    """The (name, value) pairs of a header block."""
    (count,) = _U32.unpack_from(block, 0)
    at, headers = 4, []
    for _ in range(count):
        (name_length,) = _U32.unpack_from(block, at)
        name = block[at + 4:at + 4 + name_length].decode()
        at += 4 + name_length
        (length,) = _U32.unpack_from(block, at)
        at += 4
        value = None
        if length != NO_URI:
            value, at = bytes(block[at:at + length]), at + length
        headers.append((name, value))
    return headers


def write_headers(headers: Headers) -> bytes:
    """The header block of (name, value) pairs."""
    parts = [_U32.pack(len(headers))]
    for name, value in headers:
        key = name.encode()
        parts += (_U32.pack(len(key)), key, _U32.pack(NO_URI if value is None else len(value)), value or b"")
    return b"".join(parts)


def write_sources(sources: Iterable[Source]) -> bytes:
    """A sources block."""
    parts = []
    for source in sources:
        headers = source.headers
        parts += (_SOURCE.pack(source.partition, source.offset, NO_URI if headers is None else len(headers)), headers or b"")
    return b"".join(parts)


class UriBlock(_LazyBlock[str]):
    """The uris of a frame's uris block: a batch served whole never needs them in Python, only
    passes the block back with its results."""

    kind = "uris"

    @staticmethod
    def of(uris: Sequence[str]) -> UriBlock:
        if isinstance(uris, UriBlock):
            return uris
        parts = []
        for uri in uris:
            key = uri.encode()
            parts += (_U32.pack(len(key)), key)
        return UriBlock(b"".join(parts), len(uris))

    def __getitem__(self, index):  # type: ignore[override]
        """A uri, or a slice of them as a block of its own, whose bytes are neither decoded nor
        written again (outcomes.by_batch cuts the rows of joined batches so)."""
        if not isinstance(index, slice) or index.step not in (None, 1):
            return super().__getitem__(index)
        start, stop, _ = index.indices(self.count)
        stop = max(start, stop)
        return UriBlock(memoryview(self.block)[self._offset(start):self._offset(stop)], stop - start)

    def _offset(self, index: int) -> int:
        """Where the uri at `index` starts in the block (its length: the block's end)."""
        if index >= self.count:
            return len(self.block)
        view, at = memoryview(self.block), 0
        for _ in range(index):
            (length,) = _U32.unpack_from(view, at)
            at += 4 + length
        return at

    def _read(self, view: memoryview) -> tuple[list[str], int]:
        uris, at = [], 0
        for _ in range(self.count):
            (length,) = _U32.unpack_from(view, at)
            uris.append(str(view[at + 4:at + 4 + length], "utf-8"))
            at += 4 + length
        return uris, at


@dataclass(frozen=True)
class AlikeRecords:
    """The requests of an alike batch: one format 2 layout, each request's values `value_size`
    bytes of `values` in turn."""

    uris: UriBlock
    layout: bytes
    value_size: int
    values: memoryview
    sources: SourceBlock

    def payload(self, index: int) -> bytes:
        """Request `index`'s message as it came."""
        values = self.values[index * self.value_size:(index + 1) * self.value_size]
        return message_from_parts(self.uris[index], _U32.pack(len(self.layout)) + self.layout, values)

    def records(self) -> list[tuple[str, bytes]]:
        """Each request as a batch frame carries it: (uri, its message)."""
        return [(uri, self.payload(index)) for index, uri in enumerate(self.uris)]


@dataclass(frozen=True)
class AlikeResults:
    """The results of one stacked run, for the JVM to write as format 2 messages: the layout tail
    they share, and each uri's row of `rows` (`row_size` bytes each)."""

    uris: UriBlock
    tail: bytes
    row_size: int
    rows: bytes | memoryview


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
    # kind BATCH: where each record was read.
    sources: Sequence[Source] = ()
    # kind ALIKE: the batch's requests (and no records).
    alike: AlikeRecords | None = field(default=None, repr=False)

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
        kind = _KINDS.get(header[:1])
        alike = _read_alike(frame, view, 4 + length) if kind == ALIKE else None
        records, sources = ([], ()) if kind == ALIKE else _read_records(frame, view, 4 + length)
    except (struct.error, UnicodeDecodeError) as exc:
        raise FrameError(f"a frame of {len(frame)} bytes does not parse: {exc}") from None
    if kind is None:
        raise FrameError(f"a frame header starts with {header[:1]!r}, not one of {''.join(_KINDS)}")
    if kind in (CONTROL, POLL, DRAIN):
        if records:
            raise FrameError(f"a {kind} frame carries {len(records)} records")
        return Frame(kind, "", "", header[1:] if kind == CONTROL else None, records)
    # Names and versions never hold a tab; a header value that does (a client's mistake) puts the
    # split at the last tab, and the request gets an error result either way.
    model, tab, version = header[1:].rpartition("\t")
    if not tab:
        raise FrameError(f"a batch frame header has no tab: {header[:80]!r}")
    return Frame(kind, model, version, None, records, sources, alike)


def _read_alike(frame: bytes, view: memoryview, at: int) -> AlikeRecords:
    count, layout_length = struct.unpack_from("<II", frame, at)
    at += 8
    layout = bytes(view[at:at + layout_length])
    value_size, uris_length = struct.unpack_from("<II", frame, at + layout_length)
    at += layout_length + 8
    values_at = at + uris_length
    sources_at = values_at + count * value_size
    if count == 0 or sources_at + count * _SOURCE.size != len(frame):
        raise FrameError(f"an alike batch of {count} requests of {value_size} bytes does not fill a frame of {len(frame)}")
    return AlikeRecords(UriBlock(view[at:values_at], count), layout, value_size, view[values_at:sources_at],
                        SourceBlock(view[sources_at:], count))


def _read_records(frame: bytes, view: memoryview, at: int) -> tuple[list[Record], list[Source]]:
    records, at = _records_from(frame, view, at)
    sources = SourceBlock(view[at:], len(records))
    try:
        return records, list(sources)
    except struct.error:
        raise FrameError(f"the sources of a frame of {len(records)} records run past its end") from None


def _records_from(frame: bytes, view: memoryview, at: int) -> tuple[list[Record], int]:
    """The record part that starts at `at`, and where it ends."""
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
    return records, at


@dataclass(frozen=True)
class DeadLetter:
    """A failed request as it came (key, value) with its headers, those it came with and those
    saying why it failed, for the dead-letter topic."""

    key: str | None
    value: bytes | memoryview
    headers: Headers


def write_frame(records: Iterable[tuple[str, bytes]], sections: Iterable[AlikeResults] = (),
                dead_letters: Sequence[DeadLetter] = (), answered: Sequence[int] = ()) -> bytes:
    """The results frame of (uri, payload) records, dead letters and alike sections, of the
    request frames numbered `answered`."""
    parts = [_U32.pack(len(answered)) + struct.pack(f"<{len(answered)}q", *answered), b""]
    for uri, payload in records:
        key = uri.encode()
        parts += (_U32.pack(len(key)), key, _U32.pack(len(payload)), payload)
    parts[1] = _U32.pack((len(parts) - 2) // 4)
    parts.append(_U32.pack(len(dead_letters)))
    for letter in dead_letters:
        key = None if letter.key is None else letter.key.encode()
        headers = write_headers(letter.headers)
        parts += (_U32.pack(NO_URI if key is None else len(key)), key or b"", _U32.pack(len(letter.value)), letter.value,
                  _U32.pack(len(headers)), headers)
    for section in sections:
        parts += (_U32.pack(section.uris.count), section.tail, _U32.pack(section.row_size),
                  _U32.pack(len(section.uris.block)), section.uris.block, section.rows)
    return b"".join(parts)


def read_result_frame(frame: bytes) -> list[Record]:
    """The (uri, result payload) records of a results frame, its alike sections' rows made
    messages as the JVM makes them (for tests and tools; the JVM splits these into Kafka records)."""
    return read_results(frame)[0]


def read_results(frame: bytes) -> tuple[list[Record], list[DeadLetter]]:
    """The records of a results frame, as read_result_frame reads them, and its dead letters."""
    view = memoryview(frame)
    records, at = _records_from(frame, view, 4 + 8 * _U32.unpack_from(frame, 0)[0])
    (count,), at, letters = _U32.unpack_from(frame, at), at + 4, []
    for _ in range(count):
        (length,) = _U32.unpack_from(frame, at)
        key = None if length == NO_URI else str(view[at + 4:at + 4 + length], "utf-8")
        at += 4 + (0 if key is None else length)
        (length,) = _U32.unpack_from(frame, at)
        value = bytes(view[at + 4:at + 4 + length])
        at += 4 + length
        (length,) = _U32.unpack_from(frame, at)
        letters.append(DeadLetter(key, value, read_headers(bytes(view[at + 4:at + 4 + length]))))
        at += 4 + length
    while at < len(frame):
        (count,) = _U32.unpack_from(frame, at)
        tail = bytes(view[at + 4:at + 8 + _U32.unpack_from(frame, at + 4)[0]])
        at += 4 + len(tail)
        row_size, uris_length = struct.unpack_from("<II", frame, at)
        uris = UriBlock(view[at + 8:at + 8 + uris_length], count)
        at += 8 + uris_length
        for i, uri in enumerate(uris):
            row = view[at + i * row_size:at + (i + 1) * row_size]
            records.append((uri, memoryview(message_from_parts(uri, tail, row))))
        at += count * row_size
    return records, letters


def write_batch_frame(model: str, version: str, records: Sequence[tuple[str | None, bytes]],
                      sources: Sequence[Source] | None = None) -> bytes:
    """A batch frame as the JVM writes it, by default of requests from unknown places without
    headers (for tests and tools; the job reads these, never writes them)."""
    return _with_header("B" + model + "\t" + version, records) + write_sources(sources or [Source()] * len(records))


def write_alike_frame(model: str, version: str, records: list[tuple[str | None, bytes]]) -> bytes | None:
    """The frame the JVM writes of alike requests (format 2 messages of one layout, each under its
    uri), or None when they are not alike (for tests and tools; the job reads these, never writes them)."""
    parts, values, layout = [], [], None
    for uri, payload in records:
        key = (uri or "").encode()
        at = 6 + len(key)
        if not key or payload[:6] != b"CST2" + len(key).to_bytes(2, "little") or payload[6:at] != key:
            return None
        end = at + 4 + _U32.unpack_from(payload, at)[0]
        if layout is None:
            layout, value_size = payload[at:end], len(payload) - end
        if payload[at:end] != layout or len(payload) - end != value_size:
            return None
        parts += (_U32.pack(len(key)), key)
        values.append(payload[end:])
    if layout is None:
        return None
    header = ("A" + model + "\t" + version).encode()
    uris = b"".join(parts)
    return b"".join([_U32.pack(len(header)), header, _U32.pack(len(records)), layout, _U32.pack(value_size),
                     _U32.pack(len(uris)), uris, *values, write_sources([Source()] * len(records))])


def write_control_frame(table: str) -> bytes:
    """A control frame as the JVM writes it (for tests and tools)."""
    return _with_header("C" + table, ())


def write_signal_frame(kind: str) -> bytes:
    """A POLL or DRAIN frame as the JVM writes it (for tests and tools)."""
    return _with_header({POLL: "P", DRAIN: "D"}[kind], ())


def _with_header(header: str, records: Iterable[tuple[str | None, bytes]]) -> bytes:
    encoded = header.encode()
    parts = [_U32.pack(len(encoded)), encoded, b""]
    for uri, payload in records:
        key = None if uri is None else uri.encode()
        parts += (_U32.pack(NO_URI if key is None else len(key)), key or b"", _U32.pack(len(payload)), payload)
    parts[2] = _U32.pack((len(parts) - 3) // 4)
    return b"".join(parts)
