"""The local broker is Apache Kafka: it starts on loopback with the topics asked for, keeps its
data across a restart, forgets it with --fresh, honours transactions for read_committed readers,
rebalances a group in normal time, says why in one line when it cannot start, and stops cleanly.
(The Java client inside Flink talks to it in every end-to-end test.)"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic

from cluster_serving.net.ports import port_taken
from cluster_serving.ops.children import LocalBroker
from cluster_serving.ops.processes import free_port, process_group_members
from tests.test_end_to_end import listening_addresses

RECORDS = 1000


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[LocalBroker]:
    broker = LocalBroker(tmp_path / "kafka", port=free_port(), topics={"preset": 2}, log_path=tmp_path / "broker.log")
    yield broker.start()
    broker.stop()


def produce(bootstrap: str, topic: str, count: int) -> None:
    with_producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    for i in range(count):
        with_producer.send(topic, key=f"k{i}".encode(), value=f"v{i}".encode())
    with_producer.flush()
    with_producer.close()


def read_in_group(bootstrap: str, topic: str, group_id: str, count: int, commit: bool) -> list[bytes]:
    """Up to `count` values read as member of `group_id` (from its committed offsets, else the start)."""
    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=group_id,
                             auto_offset_reset="earliest", enable_auto_commit=False)
    values: list[bytes] = []
    deadline = time.monotonic() + 30
    while len(values) < count and time.monotonic() < deadline:
        values += [record.value for records in consumer.poll(timeout_ms=500).values() for record in records]
    if commit:
        consumer.commit()
    consumer.close()
    return values


def test_topics_data_and_offsets_survive_a_restart_and_fresh_wipes_them(own_broker: LocalBroker, tmp_path: Path) -> None:
    bootstrap, port = own_broker.bootstrap_servers, int(own_broker.bootstrap_servers.rsplit(":", 1)[1])
    first_start = own_broker.ready_seconds
    with KafkaConsumer(bootstrap_servers=bootstrap) as consumer:
        assert consumer.partitions_for_topic("preset") == {0, 1}
    produce(bootstrap, "preset", RECORDS)
    assert len(read_in_group(bootstrap, "preset", "readers", RECORDS // 2, commit=True)) >= RECORDS // 2

    own_broker.stop()
    assert not port_taken("127.0.0.1", port), "the port is still held after stop"

    again = LocalBroker(own_broker.data, port=port, log_path=tmp_path / "again.log").start()
    try:
        with KafkaConsumer(bootstrap_servers=bootstrap) as consumer:
            partitions = [TopicPartition("preset", p) for p in (0, 1)]
            assert sum(consumer.end_offsets(partitions).values()) == RECORDS, "records lost over a restart"
        rest = read_in_group(bootstrap, "preset", "readers", RECORDS, commit=False)
        assert 0 < len(rest) <= RECORDS // 2 + 1, "the group's committed offsets were not kept"
    finally:
        again.stop()

    fresh = LocalBroker(own_broker.data, port=port, log_path=tmp_path / "fresh.log", fresh=True).start()
    try:
        with KafkaConsumer(bootstrap_servers=bootstrap) as consumer:
            assert "preset" not in consumer.topics(), "--fresh kept the old topics"
    finally:
        fresh.stop()
    print(json.dumps({"ready seconds, new folder": first_start, "after restart": again.ready_seconds,
                      "with --fresh": fresh.ready_seconds}))


def test_stop_leaves_no_process_and_listens_on_loopback_only(own_broker: LocalBroker) -> None:
    pgid = own_broker.process.pid
    members = process_group_members(pgid)
    assert len(members) >= 2, "expected the supervisor and the broker's JVM"
    addresses = listening_addresses(members)
    assert any(address.endswith(own_broker.bootstrap_servers.rsplit(":", 1)[1]) for address in addresses), addresses
    assert all(address.startswith(("127.", "[::ffff:127.")) for address in addresses), addresses
    process = own_broker.process
    process.send_signal(signal.SIGTERM)  # to the supervisor alone, as a service manager would
    assert process.wait(30) == 0, own_broker.log_tail()
    deadline = time.monotonic() + 10
    while process_group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not process_group_members(pgid), "the broker's JVM outlived its supervisor"


def test_read_committed_hides_aborted_transactions(broker: LocalBroker) -> None:
    bootstrap, topic = broker.bootstrap_servers, f"transactions-{time.time_ns()}"
    producer = KafkaProducer(bootstrap_servers=bootstrap, transactional_id=f"test-{topic}")
    producer.init_transactions()
    for outcome in ("aborted", "committed"):
        producer.begin_transaction()
        for i in range(10):
            producer.send(topic, key=f"{outcome}-{i}".encode(), value=b"x")
        producer.flush()  # on the broker before the outcome is decided, as a crashed writer leaves them
        producer.commit_transaction() if outcome == "committed" else producer.abort_transaction()
    producer.close()

    def keys(isolation_level: str) -> set[str]:
        consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, isolation_level=isolation_level,
                                 auto_offset_reset="earliest", consumer_timeout_ms=3000)
        seen = {record.key.decode() for record in consumer}
        consumer.close()
        return seen

    assert keys("read_committed") == {f"committed-{i}" for i in range(10)}
    assert keys("read_uncommitted") == {f"{outcome}-{i}" for outcome in ("aborted", "committed") for i in range(10)}


def test_a_second_member_joins_a_live_group_in_normal_time(broker: LocalBroker) -> None:
    bootstrap, topic, group = broker.bootstrap_servers, f"rebalance-{time.time_ns()}", f"g-{time.time_ns()}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, 2, 1)])
    admin.close()
    # The group's first assignment is made from the leader's own metadata. Without the new topic
    # in it, kafka-python's assignor hands out nothing ("No partition metadata") and the member
    # waited out the deadline with no partitions (two CI runs in many; the second after a separate
    # client had seen the topic). So each member has the topic's partitions before it subscribes.
    first, second = (KafkaConsumer(bootstrap_servers=bootstrap, group_id=group) for _ in range(2))
    deadline = time.monotonic() + 60
    for member in (first, second):
        while member.partitions_for_topic(topic) != {0, 1} and time.monotonic() < deadline:
            time.sleep(0.1)
        member.subscribe([topic])
    try:
        deadline = time.monotonic() + 60
        while len(first.assignment()) < 2 and time.monotonic() < deadline:
            first.poll(timeout_ms=100)
        assert len(first.assignment()) == 2, "the first member did not get both partitions"
        stop = threading.Event()
        keeper = threading.Thread(target=lambda: [first.poll(timeout_ms=100) for _ in iter(stop.is_set, True)])
        keeper.start()  # the first member keeps polling, as a live consumer does, while the second joins
        joining = time.monotonic()
        while not (len(second.assignment()) == 1 and len(first.assignment()) == 1) and time.monotonic() < deadline:
            second.poll(timeout_ms=100)
        joined = time.monotonic() - joining
        stop.set()
        keeper.join()
        print(json.dumps({"seconds for the second member to join a live group": round(joined, 2)}))
        assert len(first.assignment()) == len(second.assignment()) == 1, "the partitions were not shared out"
    finally:
        first.close()
        second.close()


def test_a_taken_port_is_one_error_line(tmp_path: Path, broker: LocalBroker) -> None:
    port = broker.bootstrap_servers.rsplit(":", 1)[1]
    done = subprocess.run(
        [sys.executable, "-m", "cluster_serving.ops.cli", "broker", "--port", port, "--data", str(tmp_path / "kafka")],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == f"error: 127.0.0.1:{port} is in use; stop what listens there or pick --port"
    assert not (tmp_path / "kafka").exists(), "it touched the data folder before refusing"


def test_two_brokers_started_together_on_one_port_one_serves_the_other_fails_in_one_line(tmp_path: Path) -> None:
    """Started together, both pass the port check while their JVMs start; the one that loses the
    bind must not take the winner's answers for its own readiness, and says why in one line."""
    port = free_port()
    brokers = [LocalBroker(tmp_path / name, port=port, log_path=tmp_path / f"{name}.log") for name in ("a", "b")]
    failures: dict[int, str] = {}

    def start(index: int) -> None:
        try:
            brokers[index].start()
        except RuntimeError as exc:
            failures[index] = str(exc)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    try:
        for thread in threads:
            thread.start()
            time.sleep(0.3)
        for thread in threads:
            thread.join()
        serving = [broker for broker in brokers if broker.running]
    finally:
        for broker in brokers:
            broker.stop()
    assert len(serving) == 1 and len(failures) == 1, failures
    (failure,) = failures.values()
    error_lines = [line for line in failure.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1 and "in use" in error_lines[0], failure
