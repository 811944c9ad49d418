"""The development broker as clients see it: a separate process speaking Kafka over TCP.

Brokers here cap group session timeouts at 3 s, so a rebalance after a group's first one
takes 2 s instead of 9 s; consumers heartbeat every second to stay inside that.
"""

from __future__ import annotations

import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic
from kafka.errors import InvalidTopicError, TopicAlreadyExistsError, UnknownTopicOrPartitionError

from connectors import kafka_front
from connectors.kafka_front import RequestHeader, SyncGroupRepair
from client.processes import LocalBroker
from connectors.local_broker import READY_PREFIX

REPO_ROOT = Path(__file__).resolve().parent.parent
SESSION_TIMEOUT_CAP_MS = 3000
CONSUMER_SETTINGS = {
    "auto_offset_reset": "earliest",
    "enable_auto_commit": False,
    "heartbeat_interval_ms": 1000,
}


@pytest.fixture
def fresh_broker(tmp_path: Path) -> Iterator[LocalBroker]:
    """A broker process of the test's own, stopped also when the test fails."""
    local = LocalBroker(
        log_path=str(tmp_path / "broker.log"), session_timeout_cap_ms=SESSION_TIMEOUT_CAP_MS
    )
    local.start()
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture
def admin(fresh_broker: LocalBroker) -> Iterator[KafkaAdminClient]:
    client = KafkaAdminClient(bootstrap_servers=fresh_broker.bootstrap_servers)
    try:
        yield client
    finally:
        client.close()


def group_consumer(broker: LocalBroker, topic: str, group_id: str) -> KafkaConsumer:
    return KafkaConsumer(
        topic, bootstrap_servers=broker.bootstrap_servers, group_id=group_id, **CONSUMER_SETTINGS
    )


def keyed(i: int) -> tuple[bytes, bytes]:
    return f"key-{i}".encode(), f"value-{i}".encode()


def consume(consumer: KafkaConsumer, count: int, timeout: float = 30.0) -> list:
    """Poll until ``count`` records arrived or ``timeout`` passed."""
    records: list = []
    deadline = time.monotonic() + timeout
    while len(records) < count and time.monotonic() < deadline:
        for batch in consumer.poll(timeout_ms=200).values():
            records.extend(batch)
    return records


def kafka_request(sock: socket.socket, api_key: int, version: int, body: bytes = b"") -> bytes:
    """Send one request (header v1, or v2 for flexible ApiVersions) and return the response body."""
    header = struct.pack(">hhih", api_key, version, 7, 4) + b"test"
    if api_key == kafka_front.API_VERSIONS and version >= 3:
        header += b"\x00"  # empty tagged fields
    message = header + body
    sock.sendall(struct.pack(">i", len(message)) + message)
    size = struct.unpack(">i", sock.recv(4, socket.MSG_WAITALL))[0]
    response = sock.recv(size, socket.MSG_WAITALL)
    assert struct.unpack_from(">i", response)[0] == 7  # correlation id
    return response[4:]


def test_cli_prints_one_ready_line_creates_topics_and_exits_cleanly_on_sigterm() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "connectors.local_broker", "--port", "0", "--topic", "preset:2"],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    watchdog = threading.Timer(20, process.kill)  # a broker that never gets ready fails the test
    watchdog.start()
    try:
        ready = process.stdout.readline()
        match = re.fullmatch(re.escape(READY_PREFIX) + r"127\.0\.0\.1:(\d+)\n", ready)
        assert match and int(match[1]) > 0, ready
        consumer = KafkaConsumer(bootstrap_servers=f"127.0.0.1:{match[1]}")
        try:
            assert consumer.partitions_for_topic("preset") == {0, 1}
        finally:
            consumer.close()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
        assert process.stdout.read() == ""
    finally:
        watchdog.cancel()
        process.kill()
        process.wait()


def test_stop_is_idempotent_and_frees_the_port(tmp_path: Path) -> None:
    local = LocalBroker(log_path=str(tmp_path / "broker.log")).start()
    host, port = local.bootstrap_servers.split(":")
    local.stop()
    local.stop()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=2).close()


def test_start_failure_raises_with_the_log_tail(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        local = LocalBroker(port=taken.getsockname()[1], log_path=str(tmp_path / "broker.log"))
        with pytest.raises(RuntimeError, match="cannot listen"):
            local.start()
        local.stop()


def test_api_versions_v3_is_refused_in_v0_format_and_v2_is_capped(
    fresh_broker: LocalBroker,
) -> None:
    host, port = fresh_broker.bootstrap_servers.split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        refusal = kafka_request(sock, kafka_front.API_VERSIONS, 3, b"\x01\x01\x00")
        assert kafka_front.decode_api_versions(0, refusal) == (
            kafka_front.UNSUPPORTED_VERSION,
            {kafka_front.API_VERSIONS: (0, 2)},
            0,
        )
        answer = kafka_request(sock, kafka_front.API_VERSIONS, 2)
    error, apis, _ = kafka_front.decode_api_versions(2, answer)
    assert error == 0
    assert apis[kafka_front.CREATE_TOPICS] == (0, 4)
    assert apis[kafka_front.DELETE_TOPICS] == (0, 3)
    for key, (lo, hi) in apis.items():
        cap = {**kafka_front.FORWARDED_VERSIONS, **kafka_front.LOCAL_VERSIONS}[key]
        assert cap[0] <= lo <= hi <= cap[1]
    assert 68 not in apis  # ConsumerGroupHeartbeat exists only in flexible versions


def test_kafka_python_group_reads_everything_once_and_resumes_from_commits(
    fresh_broker: LocalBroker, admin: KafkaAdminClient
) -> None:
    admin.create_topics([NewTopic("orders", num_partitions=3, replication_factor=1)])
    producer = KafkaProducer(bootstrap_servers=fresh_broker.bootstrap_servers, acks="all")
    for key, value in map(keyed, range(1000)):
        producer.send("orders", key=key, value=value)
    producer.flush()

    first = group_consumer(fresh_broker, "orders", "billing")
    try:
        records = consume(first, 1000)
        first.commit()
    finally:
        first.close()
    assert len(records) == 1000
    assert {r.key: r.value for r in records} == dict(keyed(i) for i in range(1000))
    assert {r.partition for r in records} == {0, 1, 2}

    for key, value in map(keyed, range(1000, 1010)):
        producer.send("orders", key=key, value=value)
    producer.flush()
    producer.close()

    second = group_consumer(fresh_broker, "orders", "billing")
    try:
        resumed = consume(second, 10)
        resumed += consume(second, 1, timeout=1.0)  # anything re-delivered would show up here
    finally:
        second.close()
    assert sorted(r.key for r in resumed) == sorted(keyed(i)[0] for i in range(1000, 1010))


def test_second_member_joins_a_live_group(
    fresh_broker: LocalBroker, admin: KafkaAdminClient
) -> None:
    """Both members keep polling until the group has settled on a split of the partitions; the
    split is read while both are members (a member that has left would trigger a new rebalance)."""
    admin.create_topics([NewTopic("events", num_partitions=3, replication_factor=1)])
    first = group_consumer(fresh_broker, "events", "pair")
    second_view = [frozenset[TopicPartition]()]  # replaced whole by the thread, read by the test
    stop = threading.Event()

    def run_second() -> None:
        second = group_consumer(fresh_broker, "events", "pair")
        try:
            while not stop.is_set():
                second.poll(timeout_ms=100)
                second_view[0] = frozenset(second.assignment())
        finally:
            second.close()

    def settled(first_assignment: set[TopicPartition]) -> bool:
        second_assignment = second_view[0]
        return (
            bool(second_assignment)
            and first_assignment.isdisjoint(second_assignment)
            and len(first_assignment | second_assignment) == 3
        )

    joiner = threading.Thread(target=run_second)
    try:
        while not first.assignment():
            first.poll(timeout_ms=100)
        started = time.monotonic()
        joiner.start()
        deadline = started + 20
        while not settled(first.assignment()) and time.monotonic() < deadline:
            first.poll(timeout_ms=100)
        joined_after = time.monotonic() - started
        first_assignment, seen_second = set(first.assignment()), second_view[0]
    finally:
        stop.set()
        if joiner.ident is not None:  # started
            joiner.join()
        first.close()
    assert seen_second and first_assignment.isdisjoint(seen_second)
    assert {tp.partition for tp in first_assignment | seen_second} == {0, 1, 2}
    # One rebalance takes the capped session timeout minus 1 s; a member that rejoins late
    # costs the mock another session timeout or two.
    assert joined_after < 4 * SESSION_TIMEOUT_CAP_MS / 1000


def test_topic_admin_errors(fresh_broker: LocalBroker, admin: KafkaAdminClient) -> None:
    admin.create_topics([NewTopic("audit", num_partitions=2, replication_factor=1)])
    with pytest.raises(TopicAlreadyExistsError):
        admin.create_topics([NewTopic("audit", num_partitions=2, replication_factor=1)])
    with pytest.raises(InvalidTopicError):
        admin.create_topics([NewTopic("no spaces", num_partitions=1, replication_factor=1)])
    with pytest.raises(UnknownTopicOrPartitionError):
        admin.delete_topics(["missing"])
    admin.delete_topics(["audit"])
    assert "audit" not in admin.list_topics()


def test_produce_acknowledgement_carries_the_record_timestamp(fresh_broker: LocalBroker) -> None:
    producer = KafkaProducer(bootstrap_servers=fresh_broker.bootstrap_servers, acks="all")
    try:
        metadata = producer.send("stamped", value=b"v", timestamp_ms=1_700_000_000_000).get(10)
    finally:
        producer.close()
    assert metadata.timestamp == 1_700_000_000_000


def test_acks_zero_and_transactional_records_are_readable(fresh_broker: LocalBroker) -> None:
    fire_and_forget = KafkaProducer(bootstrap_servers=fresh_broker.bootstrap_servers, acks=0)
    for i in range(20):
        fire_and_forget.send("loose", value=b"%d" % i)
    fire_and_forget.close()

    transactional = KafkaProducer(
        bootstrap_servers=fresh_broker.bootstrap_servers, transactional_id="tx"
    )
    transactional.init_transactions()
    transactional.begin_transaction()
    for i in range(5):
        transactional.send("ledger", value=b"%d" % i)
    transactional.commit_transaction()
    transactional.close()

    consumer = KafkaConsumer(bootstrap_servers=fresh_broker.bootstrap_servers, **CONSUMER_SETTINGS)
    try:
        for topic, count in (("loose", 20), ("ledger", 5)):
            partitions = consumer.partitions_for_topic(topic)
            consumer.assign([TopicPartition(topic, p) for p in partitions])
            # The commit marker ends the ledger log; reading past it checks its CRC.
            assert len(consume(consumer, count) + consume(consumer, 1, timeout=1.0)) == count
    finally:
        consumer.close()


def test_sync_group_repair_answers_a_follower_that_syncs_after_the_leader() -> None:
    def string(value: str) -> bytes:
        return struct.pack(">h", len(value)) + value.encode()

    def sync_group(member: str, assignments: dict[str, bytes]) -> tuple[RequestHeader, bytes]:
        """SyncGroup v2 for generation 3 of group "group"."""
        body = string("group") + struct.pack(">i", 3) + string(member)
        body += struct.pack(">i", len(assignments))
        for name, data in assignments.items():
            body += string(name) + struct.pack(">i", len(data)) + data
        frame = struct.pack(">hhih", kafka_front.SYNC_GROUP, 2, 1, -1) + body
        return RequestHeader.parse(frame), frame

    repair = SyncGroupRepair()
    repair.on_request(*sync_group("leader", {"leader": b"L", "follower": b"F"}))
    rewrite = repair.on_request(*sync_group("follower", {}))
    rejected = struct.pack(">ihi", 0, kafka_front.INVALID_REQUEST, -1)
    assert rewrite(rejected) == struct.pack(">ihi", 0, 0, 1) + b"F"
    other_error = struct.pack(">ihi", 0, 27, -1)  # REBALANCE_IN_PROGRESS with a null assignment
    assert rewrite(other_error) == struct.pack(">ihi", 0, 27, 0)
