"""Backpressure on real parts: a slow real model, input 5x faster than it can serve (10 s here;
`python -m bench.backpressure` runs the full 60 s), and the cluster_serving.client's queue-full guard."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import numpy as np
import pytest

from bench.backpressure import raw_capacity, run, slow_model
from cluster_serving.client import InputQueue, OutputQueue, QueueFullError
from cluster_serving.config import ServingConfig, load_config
from cluster_serving.ops.children import EmbeddedJob
from cluster_serving.ops.processes import write_run_config
from cluster_serving.ops.sample_model import FEATURES

BURST_SECONDS = 10
FACTOR = 5
LAYERS = 400


@pytest.fixture(scope="module")
def slow_job(tmp_path_factory: pytest.TempPathFactory, broker) -> Iterator[tuple[ServingConfig, EmbeddedJob, float]]:
    folder = tmp_path_factory.mktemp("backpressure")
    model = slow_model(folder / "model.onnx", LAYERS)
    capacity = raw_capacity(model, batch_size=32)
    path = write_run_config(folder, model, broker.bootstrap_servers, kafka={"partitions": 4},
                            flink={"checkpoint_interval_ms": 1000}, device="cpu")
    config = load_config(path)
    with EmbeddedJob(path, config.flink.rest_port, folder / "job.log") as job:
        yield config, job, capacity


def test_five_times_overload_loses_nothing_and_recovers(slow_job) -> None:
    config, job, capacity = slow_job
    figures = run(config, job, BURST_SECONDS, FACTOR, capacity)
    print(json.dumps(figures))
    assert figures["lost"] == 0 and figures["error results"] == 0
    assert figures["input rate (req/s)"] > 2 * figures["served rate (req/s)"], "the input did not outrun the job"
    start, peak, end = figures["job RSS MB start/peak/end"]
    assert peak - start < 1024, "the job's memory grew with the backlog instead of leaving it in Kafka"
    after_p99 = float(figures["latency after"].split("p99 ")[1].split(" ms")[0])
    assert after_p99 < 5000, f"latency did not come back after the burst: {figures['latency after']}"


def paced_enqueue(inputs: InputQueue, count: int, rate: float, prefix: str) -> int:
    """Enqueues up to `count` requests at `rate`/s; returns how many went before a QueueFullError."""
    row = np.ones(FEATURES, np.float32)
    for i in range(count):
        time.sleep(1 / rate)
        try:
            inputs.enqueue(f"{prefix}-{i}", features=row)
        except QueueFullError:
            return i
    return count


def test_queue_full_guard_refuses_or_blocks(slow_job) -> None:
    config, job, capacity = slow_job
    kafka = config.kafka
    guard = {"max_lag": 300, "job_group_id": kafka.group_id}
    with InputQueue(kafka.bootstrap_servers, kafka.input_topic, when_full="refuse", **guard) as refusing:
        accepted = paced_enqueue(refusing, 5000, rate=10 * capacity, prefix="refuse")
        assert accepted < 5000, "never refused although the job fell behind"
        assert refusing.lag() >= 300
    with InputQueue(kafka.bootstrap_servers, kafka.input_topic, when_full="block", block_timeout_s=120, **guard) as blocking:
        started = time.monotonic()
        assert paced_enqueue(blocking, 1000, rate=10 * capacity, prefix="block") == 1000
        blocked_for = time.monotonic() - started
    unguarded_seconds = 1000 / (10 * capacity)
    print(json.dumps({"accepted before refusal": accepted, "seconds to enqueue 1000 with blocking": round(blocked_for, 1),
                      "without the guard": round(unguarded_seconds, 1)}))
    assert blocked_for > unguarded_seconds + 1, "block mode did not wait for the job"
    wanted = [f"refuse-{i}" for i in range(accepted)] + [f"block-{i}" for i in range(1000)]
    deadline = time.monotonic() + 300
    with OutputQueue(kafka.bootstrap_servers, kafka.result_topic, group_id=f"{kafka.group_id}-guard") as outputs:
        unanswered = [uri for uri in wanted if outputs.query(uri, timeout=max(0.0, deadline - time.monotonic())) is None]
    assert not unanswered, f"{len(unanswered)} accepted requests unanswered, e.g. {unanswered[0]}"
