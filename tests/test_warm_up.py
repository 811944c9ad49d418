"""flink.warm_up_requests: before the job serves, in a new JVM, the same pipeline serves requests
of zeros on topics of its own (<input_topic>.warm-up, <result_topic>.warm-up) and is stopped; the
serving job then starts in that JVM. The warm-up answers every one of its requests with the model's
prediction, writes nothing to the real topics, and the real requests, written before the start,
are each answered once after it."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import psutil
from confluent_kafka import Consumer

from cluster_serving.client import InputQueue, OutputQueue
from cluster_serving.job.warm_up import (
    BURST, MAX_BYTES, SUFFIX, TAIL_FRACTIONS, TAIL_SECONDS, paced_tail, skip_earlier_requests, warm_up_bursts, warm_up_config,
    SECOND_JOB_BACKLOG_S, TIMESTAMP_OFFSETS_MS, second_job_requests, warm_up_topic_settings, write_requests,
)
from cluster_serving.jvm import find_java
from cluster_serving.kafka.admin import end_offsets, ensure_topics, topic_records
from cluster_serving.kafka.librdkafka import committed_offsets, topic_partitions
from cluster_serving.ops.children import EmbeddedJob
from cluster_serving.ops.sample_model import FEATURES
from cluster_serving.wire.codec import CONTROL_HEADER
from cluster_serving.wire.inputs import encode_request
from tests.conftest import collect, interrupted_once_logged

WARM_UP = 3000
REAL = 300


def test_a_warm_up_serves_zeros_on_topics_of_its_own_before_the_job_serves(write_config, start_job) -> None:
    path, config = write_config(flink={"warm_up_requests": WARM_UP})
    kafka = config.kafka
    features = np.random.default_rng(7).normal(size=(REAL, FEATURES)).astype(np.float32)
    uris = [f"real-{i}" for i in range(REAL)]
    with InputQueue(kafka.bootstrap_servers, kafka.input_topic) as inputs:
        inputs.enqueue_batch((uri, {"features": features[i]}) for i, uri in enumerate(uris))

    job = start_job(path, config)
    log = job.log_text()
    warmed = re.search(r"warmed up: (\d+) of (\d+) requests answered in [\d.]+ s \(the last paced at ([\d,]+), ([\d,]+), ([\d,]+) req/s\)", log)
    assert warmed, job.log_tail()
    answered, total, *rates = (int(figure.replace(",", "")) for figure in warmed.groups())
    assert answered == total > WARM_UP and 0 < rates[0] < rates[1] < rates[2]
    assert log.index("warmed up") < log.index("the JIT compiles with C1 only") < log.index(f"job {job.job_id} submitted")
    assert c2_excluded(job)

    session = ort.InferenceSession(str(config.model.path))
    with OutputQueue(kafka.bootstrap_servers, kafka.result_topic, group_id=f"{kafka.group_id}-client") as outputs:
        results = collect(outputs, REAL, 120)
    assert sorted(results) == sorted(uris)
    expected = session.run(None, {"features": features})[0]
    for i, uri in enumerate(uris):
        np.testing.assert_allclose(results[uri]["probabilities"], expected[i], atol=1e-5)

    with OutputQueue(kafka.bootstrap_servers, kafka.result_topic + SUFFIX, group_id=f"{kafka.group_id}-warm") as outputs:
        warm_results = collect(outputs, total, 60)
    assert sorted(warm_results) == sorted(f"warm-up-{i}" for i in range(total))
    zeros = session.run(None, {"features": np.zeros((1, FEATURES), np.float32)})[0][0]
    for result in warm_results.values():
        np.testing.assert_allclose(result["probabilities"], zeros, atol=1e-5)
    warm_requests = topic_records(kafka.bootstrap_servers, kafka.input_topic + SUFFIX)
    assert len([record for record in warm_requests if record.key is not None]) == total
    tables = [record for record in warm_requests if (CONTROL_HEADER, b"table") in record.headers]
    # On each partition a table before the first job's one burst, and one before the second job's backlog.
    assert len(tables) == 2 * kafka.partitions and all(record.key is None for record in tables)
    assert not [record for record in topic_records(kafka.bootstrap_servers, kafka.result_topic)
                if record.key.startswith(b"warm-up-")]


def test_with_jit_after_warm_up_c2_the_jvm_takes_no_compiler_directive(write_config, start_job) -> None:
    path, config = write_config(flink={"warm_up_requests": WARM_UP, "jit_after_warm_up": "c2"})
    job = start_job(path, config)
    assert "warmed up" in job.log_text() and "the JIT compiles" not in job.log_text()
    assert not c2_excluded(job)


def c2_excluded(job: EmbeddedJob) -> bool:
    """Whether a compiler directive of the job's JVM (its process's one child) other than the
    default one keeps every method from C2, as `jcmd <pid> Compiler.directives_print` says."""
    (jvm,) = psutil.Process(job.process.pid).children()
    jcmd = Path(find_java()).resolve().with_name("jcmd")
    printed = subprocess.run([str(jcmd), str(jvm.pid), "Compiler.directives_print"], capture_output=True, text=True, check=True).stdout
    added = [directive for directive in printed.split("Directive:")[1:] if not directive.startswith(" (default)")]
    return any("matching: *.*" in directive and "Exclude:true" in directive.split("c2 directives:")[1] for directive in added)


def test_a_warm_up_comes_in_bursts_and_at_most_max_bytes_of_requests() -> None:
    small = {"features": np.zeros(FEATURES, np.float32)}
    assert warm_up_bursts(small, 2 * BURST + 5) == [range(BURST), range(BURST, 2 * BURST), range(2 * BURST, 2 * BURST + 5)]
    large = {"image": np.zeros((3, 64, 64), np.float32)}
    capped = warm_up_bursts(large, 1_000_000)
    assert capped == [range(MAX_BYTES // len(encode_request("warm-up", large)))] and len(capped[0]) < BURST


def test_after_its_bursts_a_warm_up_paces_requests_at_fractions_of_the_rate_they_were_answered_at() -> None:
    tail = paced_tail(1000, 80_000.0)
    assert [rate for _, rate in tail] == [fraction * 80_000 for fraction in TAIL_FRACTIONS]
    assert [len(numbers) for numbers, rate in tail] == [round(rate * TAIL_SECONDS) for _, rate in tail]
    assert tail[0][0].start == 1000 and all(a.stop == b.start for (a, _), (b, _) in zip(tail, tail[1:]))
    assert [len(numbers) for numbers, _ in paced_tail(0, 2.0)] == [2, 2, 2]  # at least one a second
    backlog, paced = second_job_requests(1000, 80_000.0)
    assert backlog == range(1000, 1000 + round(80_000 * SECOND_JOB_BACKLOG_S)) and paced == paced_tail(backlog.stop, 80_000.0)


def test_a_warm_up_starts_past_the_requests_an_earlier_one_left_on_its_topic(write_config, tmp_path: Path) -> None:
    _, config = write_config()
    warm = warm_up_config(config, tmp_path)
    ensure_topics(warm.kafka)
    with InputQueue(warm.kafka.bootstrap_servers, warm.kafka.input_topic) as inputs:
        inputs.enqueue_batch((f"earlier-{i}", {"features": np.zeros(FEATURES, np.float32)}) for i in range(25))
    skip_earlier_requests(warm)
    consumer = Consumer({"bootstrap.servers": warm.kafka.bootstrap_servers, "group.id": warm.kafka.group_id})
    try:
        partitions = topic_partitions(consumer, warm.kafka.input_topic, 10)
        committed = committed_offsets(consumer, partitions, 10)
        ends = [consumer.get_watermark_offsets(partition, 10)[1] for partition in partitions]
    finally:
        consumer.close()
    assert [partition.offset for partition in committed] == ends and sum(ends) >= 25


def test_a_warm_up_waits_for_its_input_topic_to_be_known_before_it_commits_past_earlier_requests(write_config, tmp_path: Path) -> None:
    _, config = write_config(kafka={"partitions": 3})
    warm = warm_up_config(config, tmp_path)
    creating = threading.Timer(1.0, ensure_topics, (warm.kafka,))
    creating.start()
    try:
        skip_earlier_requests(warm)  # before the topic exists, then right after it was created
    finally:
        creating.join()
    consumer = Consumer({"bootstrap.servers": warm.kafka.bootstrap_servers, "group.id": warm.kafka.group_id})
    try:
        committed = committed_offsets(consumer, topic_partitions(consumer, warm.kafka.input_topic, 10), 10)
    finally:
        consumer.close()
    assert [partition.offset for partition in committed] == [0, 0, 0]


def test_every_other_burst_of_a_warm_up_is_written_in_a_transaction(write_config, tmp_path: Path) -> None:
    _, config = write_config(kafka={"partitions": 1})
    warm = warm_up_config(config, tmp_path)
    ensure_topics(warm.kafka)
    request = {"features": np.zeros(FEATURES, np.float32)}
    write_requests(warm, request, range(10))
    write_requests(warm, request, range(10, 20), transaction=True)
    ends = end_offsets(warm.kafka.bootstrap_servers, warm.kafka.input_topic)
    records = topic_records(warm.kafka.bootstrap_servers, warm.kafka.input_topic, "read_committed")
    assert [record.key for record in records] == [f"warm-up-{i}".encode() for i in range(20)]
    assert list(ends.values()) == [21]  # the transaction's commit marker takes an offset of its own


def test_warm_up_requests_are_timestamped_before_their_write_by_each_offset_in_turn(write_config, tmp_path: Path) -> None:
    """Their timestamp deltas within a Kafka batch take one, two and three bytes, as a slowly written
    backlog's do."""
    _, config = write_config(kafka={"partitions": 1})
    warm = warm_up_config(config, tmp_path)
    ensure_topics(warm.kafka)
    before_ms = time.time() * 1000
    write_requests(warm, {"features": np.zeros(FEATURES, np.float32)}, range(7))
    after_ms = time.time() * 1000
    records = topic_records(warm.kafka.bootstrap_servers, warm.kafka.input_topic)
    offsets = [TIMESTAMP_OFFSETS_MS[index % len(TIMESTAMP_OFFSETS_MS)] for index in range(7)]
    assert {_varlong_bytes(-offset) for offset in offsets} == {1, 2, 3}
    assert [record.key for record in records] == [f"warm-up-{i}".encode() for i in range(7)]
    for record, offset in zip(records, offsets, strict=True):
        assert before_ms - offset - 1 <= record.timestamp <= after_ms - offset + 1


def _varlong_bytes(value: int) -> int:
    """The bytes of Kafka's zig-zag varlong of `value`, as a record's timestamp delta is written."""
    zigzag, count = (value << 1) ^ (value >> 63), 1
    while zigzag >= 0x80:
        zigzag, count = zigzag >> 7, count + 1
    return count


def test_warm_up_topics_copy_the_serving_topics_timestamp_type(write_config, tmp_path: Path) -> None:
    _, config = write_config()
    kafka = config.kafka
    ensure_topics(kafka, per_topic={kafka.input_topic: {"message.timestamp.type": "LogAppendTime"}})
    assert warm_up_topic_settings(config) == {
        kafka.input_topic + SUFFIX: {"message.timestamp.type": "LogAppendTime"}, kafka.result_topic + SUFFIX: {},
    }


def test_a_stop_during_the_warm_up_ends_it_after_its_burst_and_serves_nothing(write_config, tmp_path: Path) -> None:
    count = 2 * BURST + 1
    path, config = write_config(flink={"warm_up_requests": count})
    job = EmbeddedJob(path, config.flink.rest_port, log_path=tmp_path / "job.log")
    assert interrupted_once_logged(job, "warming up:") == 0, job.log_tail()
    log = job.log_text()
    assert f"warmed up: {BURST} of {count} requests answered" in log, job.log_tail()
    assert not re.search(r"job [0-9a-f]{32} submitted", log)
