"""Kafka protocol front for librdkafka's in-memory mock cluster.

The mock cluster speaks enough of the Kafka protocol for librdkafka, but Java kafka-clients
and kafka-python cannot use it directly: the mock's flexible (tagged-field) encodings do not
parse in those clients, it has no CreateTopics/DeleteTopics, its ApiVersions v3 reply is
malformed, a few of its error responses carry nulls where these clients require values, the
transaction markers it writes have no CRC, and its produce responses carry a made-up log
append time. This front listens on 127.0.0.1 between the clients and the mock, opens one
upstream connection per client connection, forwards requests and responses byte for byte,
and only

* answers ApiVersions v3+ itself with UNSUPPORTED_VERSION in the v0 format (what a real
  broker does), so clients retry with v2, which is forwarded;
* rewrites the forwarded ApiVersions reply so that every API is capped at a non-flexible
  version (``FORWARDED_VERSIONS``) and lists the APIs the front serves itself;
* answers CreateTopics and DeleteTopics itself through a ``TopicAdmin``;
* caps the session timeout in JoinGroup requests, because the mock holds every rebalance
  after the first one for the group's session timeout minus one second;
* repairs the responses listed in ``RESPONSE_REWRITES`` and SyncGroup responses
  (see ``SyncGroupRepair``).

Replies go back in request order, as Kafka clients require, even when the front answers a
request itself while earlier ones are still with the mock.
"""

from __future__ import annotations

import asyncio
import logging
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol, TypeVar

log = logging.getLogger(__name__)

PRODUCE = 0
FETCH = 1
FIND_COORDINATOR = 10
JOIN_GROUP = 11
SYNC_GROUP = 14
API_VERSIONS = 18
CREATE_TOPICS = 19
DELETE_TOPICS = 20

NONE = 0
INVALID_TOPIC_EXCEPTION = 17
UNSUPPORTED_VERSION = 35
TOPIC_ALREADY_EXISTS = 36
INVALID_PARTITIONS = 37
INVALID_REQUEST = 42

# Highest ApiVersions version whose reply the front can rewrite (v3 is flexible).
API_VERSIONS_MAX = 2

# APIs forwarded to the mock, each capped at a non-flexible version (about the Kafka 2.1
# protocol). The advertised range is the intersection with what the mock reports, so an API
# missing from the mock is not advertised. What the mock offers beyond this list (KIP-848 and
# share groups, telemetry) is hidden: those APIs only exist in flexible versions.
FORWARDED_VERSIONS: dict[int, tuple[int, int]] = {
    PRODUCE: (0, 7),
    FETCH: (0, 10),
    2: (0, 5),  # ListOffsets
    3: (0, 7),  # Metadata
    8: (0, 6),  # OffsetCommit
    9: (0, 5),  # OffsetFetch
    FIND_COORDINATOR: (0, 2),
    JOIN_GROUP: (0, 4),
    12: (0, 2),  # Heartbeat
    13: (0, 2),  # LeaveGroup
    SYNC_GROUP: (0, 2),
    API_VERSIONS: (0, API_VERSIONS_MAX),
    22: (0, 1),  # InitProducerId
    23: (0, 2),  # OffsetForLeaderEpoch (the mock serves v2 only)
    24: (0, 1),  # AddPartitionsToTxn
    25: (0, 1),  # AddOffsetsToTxn
    26: (0, 1),  # EndTxn
    28: (0, 2),  # TxnOffsetCommit
}

# APIs the front answers itself; v4 of CreateTopics is the last non-flexible one.
LOCAL_VERSIONS: dict[int, tuple[int, int]] = {
    CREATE_TOPICS: (0, 4),
    DELETE_TOPICS: (0, 3),
}

# Partitions for CreateTopics v4 requests that leave the count to the broker (-1), as
# Kafka's own num.partitions default.
DEFAULT_PARTITIONS = 1

_TOPIC_NAME = re.compile(r"[a-zA-Z0-9._-]{1,249}")
_MAX_FRAME = 100 * 1024 * 1024

T = TypeVar("T")
ResponseRewrite = Callable[[bytes], bytes]
ReplySlot = asyncio.Future[bytes]


class TopicAdmin(Protocol):
    """Topic operations the front delegates to the cluster behind it."""

    def create_topic(self, name: str, partitions: int) -> int:
        """Create a topic; return a Kafka error code (0 on success)."""

    def delete_topic(self, name: str) -> int:
        """Delete a topic; return a Kafka error code (0 on success)."""


class _Reader:
    """Sequential big-endian reader for non-flexible Kafka encodings."""

    def __init__(self, data: bytes, offset: int = 0) -> None:
        self.data = data
        self.offset = offset

    def _unpack(self, fmt: str) -> int:
        (value,) = struct.unpack_from(fmt, self.data, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def int8(self) -> int:
        return self._unpack(">b")

    def int16(self) -> int:
        return self._unpack(">h")

    def int32(self) -> int:
        return self._unpack(">i")

    def int64(self) -> int:
        return self._unpack(">q")

    def _sized(self, length: int) -> bytes:
        value = self.data[self.offset : self.offset + length]
        self.offset += length
        return value

    def string(self) -> str | None:
        length = self.int16()
        return None if length < 0 else self._sized(length).decode()

    def nullable_bytes(self) -> bytes | None:
        length = self.int32()
        return None if length < 0 else self._sized(length)

    def array(self, read_item: Callable[[], T]) -> list[T]:
        count = self.int32()
        return [read_item() for _ in range(max(count, 0))]


def _string(value: str | None) -> bytes:
    if value is None:
        return struct.pack(">h", -1)
    encoded = value.encode()
    return struct.pack(">h", len(encoded)) + encoded


def _bytes(value: bytes) -> bytes:
    return struct.pack(">i", len(value)) + value


def _array(items: list[bytes]) -> bytes:
    return struct.pack(">i", len(items)) + b"".join(items)


@dataclass(frozen=True)
class RequestHeader:
    """Request header v1: api_key, api_version, correlation_id, client_id."""

    api_key: int
    api_version: int
    correlation_id: int
    body_offset: int

    @classmethod
    def parse(cls, frame: bytes) -> RequestHeader:
        reader = _Reader(frame)
        api_key, api_version, correlation_id = reader.int16(), reader.int16(), reader.int32()
        reader.string()  # client_id
        return cls(api_key, api_version, correlation_id, reader.offset)

    def body(self, frame: bytes) -> _Reader:
        return _Reader(frame, self.body_offset)


# ApiVersions


def encode_api_versions(
    version: int, error: int, apis: dict[int, tuple[int, int]], throttle_ms: int = 0
) -> bytes:
    """ApiVersions response body, v0-v2 (v0 is also the fallback for newer requests)."""
    entries = [struct.pack(">hhh", key, lo, hi) for key, (lo, hi) in sorted(apis.items())]
    body = struct.pack(">h", error) + _array(entries)
    if version >= 1:
        body += struct.pack(">i", throttle_ms)
    return body


def decode_api_versions(version: int, body: bytes) -> tuple[int, dict[int, tuple[int, int]], int]:
    """Parse an ApiVersions v0-v2 response body into (error, {key: (min, max)}, throttle)."""
    reader = _Reader(body)
    error = reader.int16()
    entries = reader.array(lambda: (reader.int16(), reader.int16(), reader.int16()))
    throttle_ms = reader.int32() if version >= 1 else 0
    return error, {key: (lo, hi) for key, lo, hi in entries}, throttle_ms


def advertised_versions(upstream: dict[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """Intersect the mock's API ranges with the caps and add the APIs served locally."""
    apis = dict(LOCAL_VERSIONS)
    for key, (cap_lo, cap_hi) in FORWARDED_VERSIONS.items():
        if key in upstream:
            lo, hi = max(upstream[key][0], cap_lo), min(upstream[key][1], cap_hi)
            if lo <= hi:
                apis[key] = (lo, hi)
    return apis


def rewrite_api_versions(version: int, body: bytes) -> bytes:
    """Advertise the capped ranges instead of the mock's own."""
    error, upstream, throttle_ms = decode_api_versions(version, body)
    if error != NONE:
        return body
    return encode_api_versions(version, NONE, advertised_versions(upstream), throttle_ms)


# Repairs of mock responses that Java and Python clients cannot parse or would misread


def fix_find_coordinator(version: int, body: bytes) -> bytes:
    """Replace the null host the mock sends with errors; v0-v2 clients require a string."""
    reader = _Reader(body)
    if version >= 1:
        reader.int32()  # throttle_time_ms
    error = reader.int16()
    if version >= 1:
        reader.string()  # error_message
    if error == NONE:
        return body
    return body[: reader.offset] + struct.pack(">i", -1) + _string("") + struct.pack(">i", -1)


def fix_join_group(version: int, body: bytes) -> bytes:
    """Replace the null protocol, leader and member ids the mock sends with errors."""
    reader = _Reader(body)
    if version >= 2:
        reader.int32()  # throttle_time_ms
    if reader.int16() == NONE:
        return body
    return body[: reader.offset] + struct.pack(">i", -1) + _string("") * 3 + _array([])


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), the checksum of Kafka record batches."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


_CONTROL_BATCH = 0x20


def _control_batch_crcs(body: bytes, start: int, end: int) -> list[tuple[int, int]]:
    """(offset, crc) for each v2 control batch in body[start:end]."""
    fixes: list[tuple[int, int]] = []
    position = start
    while position + 23 <= end:  # up to and including the attributes
        (batch_length,) = struct.unpack_from(">i", body, position + 8)
        batch_end = position + 12 + batch_length
        if batch_length <= 0 or batch_end > end:
            break  # a batch cut off at the fetch size limit, or garbage
        magic = body[position + 16]
        (attributes,) = struct.unpack_from(">h", body, position + 21)
        if magic == 2 and attributes & _CONTROL_BATCH:
            fixes.append((position + 17, crc32c(body[position + 21 : batch_end])))
        position = batch_end
    return fixes


def fix_fetch(version: int, body: bytes) -> bytes:
    """Fill in the CRC of transaction control batches, which the mock leaves at zero.

    Clients check batch CRCs by default, so without this any topic written by a
    transactional producer becomes unreadable at its first commit or abort marker.
    """
    reader = _Reader(body)
    if version >= 1:
        reader.int32()  # throttle_time_ms
    if version >= 7:
        reader.int16(), reader.int32()  # error_code, session_id
    fixes: list[tuple[int, int]] = []
    for _ in range(reader.int32()):  # topics
        reader.string()
        for _ in range(reader.int32()):  # partitions
            reader.int32(), reader.int16(), reader.int64()  # index, error_code, high_watermark
            if version >= 4:
                reader.int64()  # last_stable_offset
            if version >= 5:
                reader.int64()  # log_start_offset
            if version >= 4:
                reader.array(lambda: (reader.int64(), reader.int64()))  # aborted_transactions
            size = reader.int32()
            start, reader.offset = reader.offset, reader.offset + max(size, 0)
            fixes += _control_batch_crcs(body, start, reader.offset)
    if not fixes:
        return body
    patched = bytearray(body)
    for offset, crc in fixes:
        struct.pack_into(">I", patched, offset, crc)
    return bytes(patched)


def fix_produce(version: int, body: bytes) -> bytes:
    """Report no log append time, as Kafka does for CreateTime topics.

    The mock answers every produce with log_append_time 1234 (1970), which clients would
    hand to producer callbacks as the record timestamp.
    """
    if version < 2:
        return body
    patched = bytearray(body)
    reader = _Reader(body)
    for _ in range(reader.int32()):  # topics
        reader.string()
        for _ in range(reader.int32()):  # partitions
            reader.int32(), reader.int16(), reader.int64()  # index, error_code, base_offset
            struct.pack_into(">q", patched, reader.offset, -1)
            reader.int64()  # log_append_time_ms
            if version >= 5:
                reader.int64()  # log_start_offset
    return bytes(patched)


# Rewrites of mock response bodies, by API key: (api_version, body) -> body.
RESPONSE_REWRITES: dict[int, Callable[[int, bytes], bytes]] = {
    PRODUCE: fix_produce,
    API_VERSIONS: rewrite_api_versions,
    FETCH: fix_fetch,
    FIND_COORDINATOR: fix_find_coordinator,
    JOIN_GROUP: fix_join_group,
}


@dataclass(frozen=True)
class SyncGroupRequest:
    """The fields of a SyncGroup v0-v2 request that the repair needs."""

    group_id: str
    generation_id: int
    member_id: str
    assignments: dict[str, bytes]

    @classmethod
    def parse(cls, header: RequestHeader, frame: bytes) -> SyncGroupRequest:
        reader = header.body(frame)
        group_id = reader.string() or ""
        generation_id = reader.int32()
        member_id = reader.string() or ""
        pairs = reader.array(lambda: (reader.string() or "", reader.nullable_bytes() or b""))
        return cls(group_id, generation_id, member_id, dict(pairs))


class SyncGroupRepair:
    """Answers followers whose SyncGroup the mock rejects after the leader's.

    The mock ends a sync round as soon as the leader's SyncGroup carries an assignment for
    every member, and then rejects a follower's SyncGroup for that same generation with
    INVALID_REQUEST although the follower is in the group. Java clients treat that as fatal.
    The front keeps the assignments of each group's latest leader SyncGroup and answers such
    a follower with its assignment. It also replaces the null assignment the mock sends with
    other errors by an empty one, as clients require.
    """

    def __init__(self) -> None:
        self._latest: dict[str, tuple[int, dict[str, bytes]]] = {}

    def on_request(self, header: RequestHeader, frame: bytes) -> ResponseRewrite:
        """Record a leader's assignments; return the rewrite for this request's response."""
        request = SyncGroupRequest.parse(header, frame)
        if request.assignments:
            self._latest[request.group_id] = (request.generation_id, request.assignments)
        return partial(self._fix_response, request, header.api_version)

    def _fix_response(self, request: SyncGroupRequest, version: int, body: bytes) -> bytes:
        error_offset = 4 if version >= 1 else 0  # after throttle_time_ms
        (error,) = struct.unpack_from(">h", body, error_offset)
        generation_id, assignments = self._latest.get(request.group_id, (None, {}))
        if (
            error == INVALID_REQUEST
            and generation_id == request.generation_id
            and request.member_id in assignments
        ):
            assignment = assignments[request.member_id]
            return body[:error_offset] + struct.pack(">h", NONE) + _bytes(assignment)
        if _Reader(body, error_offset + 2).nullable_bytes() is None:
            return body[: error_offset + 2] + _bytes(b"")
        return body


# Request-side handling


def produce_expects_response(header: RequestHeader, frame: bytes) -> bool:
    """Whether the client waits for a response: not for acks=0."""
    body = header.body(frame)
    if header.api_version >= 3:
        body.string()  # transactional_id
    return body.int16() != 0


def cap_join_group_session_timeout(header: RequestHeader, frame: bytes, cap_ms: int) -> bytes:
    """Return the JoinGroup request with session_timeout_ms lowered to at most ``cap_ms``.

    session_timeout_ms directly follows group_id in every JoinGroup version, so it is
    patched in place.
    """
    body = header.body(frame)
    body.string()  # group_id
    session_timeout_ms = struct.unpack_from(">i", frame, body.offset)[0]
    if session_timeout_ms <= cap_ms:
        return frame
    patched = bytearray(frame)
    struct.pack_into(">i", patched, body.offset, cap_ms)
    return bytes(patched)


def _topic_name_error(name: str) -> int:
    if name in (".", "..") or not _TOPIC_NAME.fullmatch(name):
        return INVALID_TOPIC_EXCEPTION
    return NONE


def _error_message(error: int) -> str | None:
    messages = {
        NONE: None,
        INVALID_TOPIC_EXCEPTION: "Invalid topic name",
        INVALID_PARTITIONS: "Number of partitions must be larger than 0",
        TOPIC_ALREADY_EXISTS: "Topic already exists",
    }
    return messages.get(error, f"Kafka error {error}")


def handle_create_topics(admin: TopicAdmin, header: RequestHeader, frame: bytes) -> bytes:
    """Serve CreateTopics v0-v4 through ``admin``; return the response body.

    Replication factor and topic configs are accepted and ignored (the mock has one broker
    and no topic configs); explicit replica assignments only set the partition count.
    validate_only checks the name and partition count, not whether the topic exists.
    """
    reader = header.body(frame)

    def read_topic() -> tuple[str, int, int]:
        name = reader.string() or ""
        partitions = reader.int32()
        reader.int16()  # replication_factor
        assignments = reader.array(lambda: (reader.int32(), reader.array(reader.int32)))
        reader.array(lambda: (reader.string(), reader.string()))  # configs
        return name, partitions, len(assignments)

    topics = reader.array(read_topic)
    reader.int32()  # timeout_ms
    validate_only = header.api_version >= 1 and reader.int8() != 0

    results = []
    for name, partitions, assigned in topics:
        partitions = assigned or (DEFAULT_PARTITIONS if partitions == -1 else partitions)
        error = _topic_name_error(name) or (INVALID_PARTITIONS if partitions <= 0 else NONE)
        if not error and not validate_only:
            error = admin.create_topic(name, partitions)
        entry = _string(name) + struct.pack(">h", error)
        if header.api_version >= 1:
            entry += _string(_error_message(error))
        results.append(entry)

    throttle = struct.pack(">i", 0) if header.api_version >= 2 else b""
    return throttle + _array(results)


def handle_delete_topics(admin: TopicAdmin, header: RequestHeader, frame: bytes) -> bytes:
    """Serve DeleteTopics v0-v3 through ``admin``; return the response body."""
    reader = header.body(frame)
    names = reader.array(lambda: reader.string() or "")
    results = [_string(name) + struct.pack(">h", admin.delete_topic(name)) for name in names]
    throttle = struct.pack(">i", 0) if header.api_version >= 1 else b""
    return throttle + _array(results)


# Connections


async def _read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """Read one size-prefixed Kafka frame; None on a clean end of stream."""
    try:
        size_bytes = await reader.readexactly(4)
    except asyncio.IncompleteReadError as eof:
        if eof.partial:
            raise
        return None
    (size,) = struct.unpack(">i", size_bytes)
    if not 0 <= size <= _MAX_FRAME:
        raise ValueError(f"bad Kafka frame size {size}")
    return await reader.readexactly(size)


def _write_frame(writer: asyncio.StreamWriter, payload: bytes) -> None:
    writer.write(struct.pack(">i", len(payload)) + payload)


class _Connection:
    """One client connection and its upstream connection to the mock."""

    def __init__(
        self,
        front: KafkaFront,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self._front = front
        self._client_reader, self._client_writer = client
        self._upstream_reader, self._upstream_writer = upstream
        # Requests with the mock, by correlation id: the reply slot (None when the client
        # expects no response) and the response rewrite.
        self._pending: dict[int, tuple[ReplySlot | None, ResponseRewrite | None]] = {}
        # One reply slot per request that expects a response, in request order.
        self._replies: asyncio.Queue[ReplySlot] = asyncio.Queue()

    async def run(self) -> None:
        tasks = [
            asyncio.create_task(self._pump_requests()),
            asyncio.create_task(self._pump_upstream()),
            asyncio.create_task(self._pump_replies()),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.exception() is not None:
                    log.info("client connection ended: %r", task.exception())
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for writer in (self._client_writer, self._upstream_writer):
                writer.close()

    async def _pump_requests(self) -> None:
        while (frame := await _read_frame(self._client_reader)) is not None:
            header = RequestHeader.parse(frame)
            log.debug("request api_key=%d version=%d", header.api_key, header.api_version)
            local_reply = self._local_reply(header, frame)
            if local_reply is not None:
                reply = struct.pack(">i", header.correlation_id) + local_reply
                self._add_reply_slot().set_result(reply)
                continue
            frame, rewrite = self._prepare_forward(header, frame)
            # The mock answers acks=0 produce requests too; such answers get no reply slot.
            expects_response = header.api_key != PRODUCE or produce_expects_response(header, frame)
            slot = self._add_reply_slot() if expects_response else None
            self._pending[header.correlation_id] = (slot, rewrite)
            _write_frame(self._upstream_writer, frame)
            await self._upstream_writer.drain()

    def _add_reply_slot(self) -> ReplySlot:
        slot: ReplySlot = asyncio.get_running_loop().create_future()
        self._replies.put_nowait(slot)
        return slot

    def _local_reply(self, header: RequestHeader, frame: bytes) -> bytes | None:
        """Body of the reply the front gives itself, or None to forward the request."""
        if header.api_key == API_VERSIONS and header.api_version > API_VERSIONS_MAX:
            return encode_api_versions(
                0, UNSUPPORTED_VERSION, {API_VERSIONS: FORWARDED_VERSIONS[API_VERSIONS]}
            )
        if header.api_key == CREATE_TOPICS:
            return handle_create_topics(self._front.admin, header, frame)
        if header.api_key == DELETE_TOPICS:
            return handle_delete_topics(self._front.admin, header, frame)
        return None

    def _prepare_forward(
        self, header: RequestHeader, frame: bytes
    ) -> tuple[bytes, ResponseRewrite | None]:
        """The request bytes for the mock and the rewrite its response body needs."""
        if header.api_key == SYNC_GROUP:
            return frame, self._front.sync_group_repair.on_request(header, frame)
        if header.api_key == JOIN_GROUP:
            cap_ms = self._front.session_timeout_cap_ms
            frame = cap_join_group_session_timeout(header, frame, cap_ms)
        rewrite = RESPONSE_REWRITES.get(header.api_key)
        return frame, None if rewrite is None else partial(rewrite, header.api_version)

    async def _pump_upstream(self) -> None:
        while (frame := await _read_frame(self._upstream_reader)) is not None:
            (correlation_id,) = struct.unpack_from(">i", frame)
            slot, rewrite = self._pending.pop(correlation_id)
            if slot is not None:
                slot.set_result(frame if rewrite is None else frame[:4] + rewrite(frame[4:]))
        raise ConnectionError("mock cluster closed the connection")

    async def _pump_replies(self) -> None:
        while True:
            reply = await (await self._replies.get())
            _write_frame(self._client_writer, reply)
            await self._client_writer.drain()


class KafkaFront:
    """TCP listener that makes the mock cluster usable by Java and Python Kafka clients."""

    def __init__(
        self, admin: TopicAdmin, upstream: tuple[str, int], session_timeout_cap_ms: int
    ) -> None:
        self.admin = admin
        self.session_timeout_cap_ms = session_timeout_cap_ms
        self.sync_group_repair = SyncGroupRepair()
        self._upstream = upstream
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (port 0 picks a free one); return the bound port."""
        self._server = await asyncio.start_server(self._serve, host, port)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening and drop every client connection."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            upstream = await asyncio.open_connection(*self._upstream)
        except OSError as error:
            log.error("cannot reach the mock cluster for a client connection: %s", error)
            writer.close()
        else:
            await _Connection(self, (reader, writer), upstream).run()
        finally:
            self._connections.discard(task)
