"""Nothing lost: a job killed with SIGKILL while requests are in flight, a task that fails inside
the job, and a stopped and restarted job all end with every uri answered exactly once through
OutputQueue (at least once: replays collapsed and counted). With delivery exactly_once the SIGKILL
run must show a read_committed reader every uri exactly once, with no replay to collapse: the
results written again after the kill sit in aborted transactions, visible only to read_uncommitted.
The same holds for the dead letters of the bad requests sent among them: each on the dead-letter
topic once, as it was sent. Both SIGKILL runs send 10,000 requests to the local Kafka broker
(KAFKA_BOOTSTRAP=host:port runs the exactly-once one against another Kafka)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort
from kafka import KafkaProducer

from cluster_serving.client import InputQueue, OutputQueue
from cluster_serving.config import ServingConfig, load_config
from cluster_serving.kafka.admin import records_written, topic_records
from cluster_serving.ops.children import EmbeddedJob
from cluster_serving.ops.processes import write_run_config
from cluster_serving.ops.sample_model import FEATURES
from tests.conftest import collect, interrupted_once_logged
from tests.failing_job import FAILURE

KILL_COUNT = 10_000
# Requests that cannot be read, sent with the exactly-once run's: each must have one error result
# and one dead letter.
BAD_COUNT = 500
FAIL_COUNT = 2_000
OTHER_KAFKA = os.environ.get("KAFKA_BOOTSTRAP", "")


def results_written(config: ServingConfig, isolation_level: str = "read_uncommitted") -> int:
    """How many records the result topic holds (duplicates included); read_committed: up to the
    first open transaction's records."""
    topic = config.kafka.result_topic
    return records_written([topic], bootstrap_servers=config.kafka.bootstrap_servers, isolation_level=isolation_level)[topic]


def kill_between_checkpoints(job: EmbeddedJob, config: ServingConfig, timeout_s: float = 60) -> None:
    """SIGKILLs the job when 0.4 of a checkpoint interval has passed since a checkpoint completed
    (the JobManager's log line): what it wrote since sits in an open transaction the restore must
    abort (exactly once), or is read again (at least once). A kill timed by results alone could
    land just after a barrier, before anything was written behind it, and test nothing. The REST
    API's checkpoint figures are cached for seconds, too stale to time it by."""
    log_file = next(config.flink_log_dir.glob("flink-*.log"))
    wait_s = 0.4 * config.flink.checkpoint_interval_ms / 1000
    deadline = time.monotonic() + timeout_s
    completed_at = None
    with log_file.open(errors="replace") as log:
        log.seek(0, os.SEEK_END)
        while time.monotonic() < deadline:
            if "Completed checkpoint" in log.read():
                completed_at = time.monotonic()
            elif completed_at is not None and time.monotonic() - completed_at > wait_s:
                job.kill()
                return
            time.sleep(0.005)
    raise AssertionError(f"no checkpoint completed in {timeout_s:.0f} s to time the kill by")


def count_results(config: ServingConfig, isolation_level: str) -> int:
    """Result records a reader with that isolation level sees, read from the start to the end."""
    return len(topic_records(config.kafka.bootstrap_servers, config.kafka.result_topic, isolation_level))


# Requests per second the clients send: the job serves tens of thousands a second, so an unpaced
# stream of 10,000 was all answered before a kill at a third of them could land.
SEND_RATE = 2000
# Requests sent together: steps of 10 every 5 ms, a steady stream, so that results are written
# at any moment of a checkpoint interval, the moment of the kill among them.
SEND_STEP = 10


def send(config: ServingConfig, features: np.ndarray, first: int = 0, rate: float = SEND_RATE) -> Future[int]:
    """Enqueues one request per row (uris req-<first>...) in the background at `rate` a second, as
    clients keep doing while a job dies; result() waits for the flush and re-raises a client error."""
    def paced() -> Iterator[tuple[str, dict]]:
        started = time.monotonic()
        for i, row in enumerate(features):
            if i % SEND_STEP == 0:
                time.sleep(max(0.0, started + i / rate - time.monotonic()))
            yield f"req-{first + i}", {"features": row}

    def produce() -> int:
        with InputQueue(config.kafka.bootstrap_servers, config.kafka.input_topic) as inputs:
            return inputs.enqueue_batch(paced())

    return ThreadPoolExecutor(max_workers=1).submit(produce)


def bad_request(i: int) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    """The key, value and headers of bad request i: not a message at all, with a header of its own."""
    return f"bad-{i}".encode(), b"\x00not a request " + str(i).encode(), [("trace-id", f"t-{i}".encode())]


def send_bad(config: ServingConfig, count: int, rate: float) -> Future[int]:
    """Sends `count` bad requests in the background at `rate` a second, as send() does good ones."""
    def produce() -> int:
        producer = KafkaProducer(bootstrap_servers=config.kafka.bootstrap_servers)
        started = time.monotonic()
        for i in range(count):
            time.sleep(max(0.0, started + i / rate - time.monotonic()))
            key, value, headers = bad_request(i)
            producer.send(config.kafka.input_topic, key=key, value=value, headers=headers)
        producer.flush()
        producer.close()
        return count

    return ThreadPoolExecutor(max_workers=1).submit(produce)


def check_all_answered_once(config: ServingConfig, features: np.ndarray, timeout: float, bad: int = 0) -> dict:
    """Every uri's one visible result equals ONNX Runtime's, and each of the `bad` requests has
    its error result; returns the figures to print."""
    kafka = config.kafka
    with OutputQueue(kafka.bootstrap_servers, kafka.result_topic, group_id=f"{kafka.group_id}-client") as outputs:
        results = collect(outputs, len(features) + bad, timeout)
        duplicates = outputs.store.duplicates
    refused = {f"bad-{i}" for i in range(bad)}
    assert all(results[uri].error_code == "bad_request" for uri in refused & set(results))
    results = {uri: result for uri, result in results.items() if uri not in refused}
    expected = ort.InferenceSession(str(config.model.path)).run(None, {"features": features})[0]
    missing = [i for i in range(len(features)) if f"req-{i}" not in results]
    wrong = [i for i in range(len(features)) if f"req-{i}" in results
             and not np.allclose(results[f"req-{i}"].get("probabilities", np.nan), expected[i], atol=1e-5)]
    assert not missing, f"{len(missing)} of {len(features)} uris never answered, e.g. req-{missing[0]}"
    assert not wrong, f"{len(wrong)} wrong results, e.g. req-{wrong[0]}: {results[f'req-{wrong[0]}']}"
    assert set(results) == {f"req-{i}" for i in range(len(features))}
    return {"sent": len(features), "answered": len(results), "lost": len(missing), "duplicates collapsed": duplicates}


def test_sigkill_while_requests_are_in_flight_loses_nothing(write_config, tmp_path: Path) -> None:
    path, config = write_config(kafka={"partitions": 4}, batching={"batch_size": 32, "max_delay_ms": 20})
    figures = kill_and_restart(path, config, KILL_COUNT, tmp_path)
    print(json.dumps(figures))


def test_exactly_once_sigkill_shows_every_result_once(broker, sample_model: Path, tmp_path: Path) -> None:
    path = write_run_config(tmp_path, sample_model, OTHER_KAFKA or broker.bootstrap_servers,
                            kafka={"delivery": "exactly_once", "partitions": 4},
                            batching={"batch_size": 32, "max_delay_ms": 20}, flink={"checkpoint_interval_ms": 1000})
    config = load_config(path)
    figures = kill_and_restart(path, config, KILL_COUNT, tmp_path, bad=BAD_COUNT)  # OutputQueue reads read_committed
    figures["results read_uncommitted (aborted included)"] = count_results(config, "read_uncommitted")
    figures["results read_committed"] = count_results(config, "read_committed")
    dead_letters = topic_records(config.kafka.bootstrap_servers, config.kafka.dead_letters, "read_committed")
    figures["dead letters read_committed"] = len(dead_letters)
    print(json.dumps(figures))
    assert figures["duplicates collapsed"] == 0, "a read_committed reader saw a result twice"
    assert figures["results read_committed"] == KILL_COUNT + BAD_COUNT
    assert figures["results read_uncommitted (aborted included)"] > KILL_COUNT + BAD_COUNT, (
        "no result was written twice, so the kill did not test the transactions")
    assert sorted(letter.key for letter in dead_letters) == sorted(bad_request(i)[0] for i in range(BAD_COUNT))
    sent = {(record.partition, record.offset): record.key
            for record in topic_records(config.kafka.bootstrap_servers, config.kafka.input_topic)}
    for letter in dead_letters:
        key, value, headers = bad_request(int(letter.key.decode().removeprefix("bad-")))
        got = dict(letter.headers)
        assert letter.value == value and got["trace-id"] == headers[0][1], "a dead letter is not the request as sent"
        assert got["cluster-serving-error-code"] == b"bad_request"
        assert got["cluster-serving-source-topic"] == config.kafka.input_topic.encode()
        assert sent[int(got["cluster-serving-source-partition"]), int(got["cluster-serving-source-offset"])] == key


class StartedByCli(EmbeddedJob):
    """The job as an operator restarts it: `cluster-serving start --no-http -c CONFIG`."""

    module = "cluster_serving.ops.cli"

    def __init__(self, config_path: Path, rest_port: int, log_path: Path):
        super().__init__(config_path, rest_port, log_path)
        self.args = ["start", "--no-http", "--config", str(config_path)]


def kill_and_restart(path: Path, config: ServingConfig, count: int, folder: Path, bad: int = 0) -> dict:
    """SIGKILLs the job once a third of the results are written, starts it again with
    `cluster-serving start` and checks that every uri is answered once, `bad` bad requests sent
    among the good ones; returns the figures."""
    features = np.random.default_rng(3).normal(size=(count, FEATURES)).astype(np.float32)
    first = EmbeddedJob(path, config.flink.rest_port, log_path=folder / "job-1.log").start()
    second = StartedByCli(path, config.flink.rest_port, log_path=folder / "job-2.log")
    try:
        producer = send(config, features)
        bad_producer = send_bad(config, bad, bad * SEND_RATE / count) if bad else None
        deadline = time.monotonic() + 120
        while results_written(config) < count // 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        kill_between_checkpoints(first, config)
        at_kill = results_written(config)
        assert producer.result() == count
        assert bad_producer is None or bad_producer.result() == bad
        assert 0 < at_kill < count, f"the kill did not land mid-stream ({at_kill} results written)"
        restarted = time.monotonic()
        second.start()
        figures = check_all_answered_once(config, features, timeout=240, bad=bad)
        figures |= {"results written before SIGKILL": at_kill, "seconds from restart to all answered": round(time.monotonic() - restarted, 1)}
    finally:
        first.stop()
        second.stop()
    assert "resuming from the retained checkpoint" in second.log_text()
    return figures


class FailingJob(EmbeddedJob):
    """The job whose inference fails once (tests/failing_job.py)."""

    module = "tests.failing_job"


def test_task_failure_is_recovered_by_the_restart_strategy(write_config, tmp_path: Path) -> None:
    path, config = write_config(batching={"batch_size": 16, "max_delay_ms": 20})
    job = FailingJob(path, config.flink.rest_port, log_path=tmp_path / "failing-job.log")
    try:
        job.start()
        recovered(job, config)
    finally:
        job.stop()


def recovered(job: FailingJob, config: ServingConfig) -> None:
    """Every request answered once, and the one failure in the job's exception history."""
    features = np.random.default_rng(4).normal(size=(FAIL_COUNT, FEATURES)).astype(np.float32)
    assert send(config, features).result() == FAIL_COUNT
    figures = check_all_answered_once(config, features, timeout=180)
    # One failure, recovered: the exception history (what the web UI's Exceptions tab shows) holds it.
    # numRestarts stays 0 here: Flink counts only global failovers there, not a region's restart.
    deadline = time.monotonic() + 30  # the REST API serves a cached view of the job, a few seconds old
    while not (history := job.rest(f"/jobs/{job.job_id}/exceptions")["exceptionHistory"]["entries"]) and time.monotonic() < deadline:
        time.sleep(1)
    print(json.dumps(figures | {"task failures recovered": len(history)}))
    assert len(history) == 1 and FAILURE in json.dumps(history)
    assert job.rest(f"/jobs/{job.job_id}")["state"] == "RUNNING"


def test_stop_takes_a_final_savepoint_and_start_resumes_there(write_config, tmp_path: Path) -> None:
    """A clean stop flushes everything: requests sent while the job was down are answered after the
    next start, and nothing already answered is replayed (no duplicates)."""
    path, config = write_config()
    features = np.random.default_rng(6).normal(size=(600, FEATURES)).astype(np.float32)
    first = EmbeddedJob(path, config.flink.rest_port, log_path=tmp_path / "job-1.log").start()
    assert send(config, features[:300]).result() == 300
    kafka = config.kafka
    with OutputQueue(kafka.bootstrap_servers, kafka.result_topic, group_id=f"{kafka.group_id}-first-half") as outputs:
        assert len(collect(outputs, 300, timeout=60)) == 300
    first.stop()
    assert "final savepoint" in first.log_text() and "cancelling" not in first.log_text(), first.log_tail()
    assert send(config, features[300:], first=300).result() == 300
    second = EmbeddedJob(path, config.flink.rest_port, log_path=tmp_path / "job-2.log")
    try:
        second.start()
        figures = check_all_answered_once(config, features, timeout=120)
    finally:
        second.stop()
    print(json.dumps(figures))
    assert "resuming from the retained savepoint" in second.log_text()
    assert figures["duplicates collapsed"] == 0


def test_a_stop_asked_as_the_job_is_submitted_stops_it_cleanly(write_config, tmp_path: Path) -> None:
    """Ctrl-C the moment the job is submitted, before its tasks run: the job process waits until
    they can take the final savepoint, takes it and exits 0."""
    path, config = write_config()
    job = EmbeddedJob(path, config.flink.rest_port, log_path=tmp_path / "job.log")
    assert interrupted_once_logged(job, job.ready_pattern.pattern) == 0, job.log_tail()
    assert "final savepoint file:" in job.log_text() and "cancelling" not in job.log_text(), job.log_tail()
