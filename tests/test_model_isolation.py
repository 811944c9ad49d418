"""Models side by side in a running job: a model held up costs another nothing, a flooded one
refuses clearly, and slow batches still in flight at a checkpoint are neither lost nor answered
twice after a SIGKILL under exactly_once (the JVM batcher's drain frame before every barrier).

The held-up model waits at a gate (a file the test creates) in its preprocess function, so that
what is running when is the test's doing, not the machine's speed."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import yaml

from cluster_serving.client import InputQueue, OutputQueue
from cluster_serving.config import load_config
from cluster_serving.kafka.admin import topic_records
from cluster_serving.ops.children import EmbeddedJob
from cluster_serving.ops.processes import write_run_config
from tests.conftest import collect
from tests.onnx_models import WIDTH, scale_model
from tests.test_recovery import StartedByCli, count_results, kill_between_checkpoints, results_written
from tests.test_scheduler import GATED

SLEEPS = """import time


def sleep_a_while(inputs):
    time.sleep(0.05)
    return inputs
"""


def repository(root: Path, slow_settings: dict, stages: str) -> Path:
    """fast (y = 2x, at once) and slow (y = 3x, behind `stages`' preprocess function)."""
    scale_model(root / "fast" / "1" / "model.onnx", 2.0)
    scale_model(root / "slow" / "1" / "model.onnx", 3.0)
    (root / "slow" / "servable.yaml").write_text(yaml.safe_dump(slow_settings))
    (root / "slow" / "servable.py").write_text(stages)
    return root


def send_paced(config, requests: list[tuple[str, str, np.ndarray]], rate: float) -> int:
    with InputQueue(config.kafka.bootstrap_servers, config.kafka.input_topic) as inputs:
        started = time.monotonic()
        for i, (uri, model, x) in enumerate(requests):
            inputs.enqueue(uri, model=model, x=x)
            if i % 10 == 0:
                time.sleep(max(0.0, started + i / rate - time.monotonic()))
        inputs.flush()
    return len(requests)


def queues(config) -> tuple[InputQueue, OutputQueue]:
    kafka = config.kafka
    return (InputQueue(kafka.bootstrap_servers, kafka.input_topic),
            OutputQueue(kafka.bootstrap_servers, kafka.result_topic, group_id=f"{kafka.group_id}-client"))


def test_a_held_up_model_leaves_the_other_serving_and_a_flooded_one_refuses_clearly(tmp_path, write_config, start_job) -> None:
    root = repository(tmp_path / "models", {
        "preprocess": {"function": "wait_for_gate"}, "max_queue_size": 4,
        "batching": {"batch_size": 2, "max_delay_ms": 5},
    }, GATED)
    gate = root / "slow" / "gate"
    # No checkpoint (and its drain frame) within the test: the slow results come back on poll frames.
    path, config = write_config(models={"repository": str(root), "default": "fast"}, flink={"checkpoint_interval_ms": 600_000})
    start_job(path, config)
    x = np.arange(WIDTH, dtype=np.float32)
    inputs, outputs = queues(config)
    with inputs, outputs:
        for i in range(12):
            inputs.enqueue(f"slow-{i}", model="slow", x=x + i)
            inputs.flush()
            time.sleep(0.05)  # a batch each, or so: one at the gate, four requests waiting, the rest refused
        refused = collect(outputs, 0, timeout=60, uris={f"slow-{i}" for i in range(6, 12)})
        for i in range(40):
            inputs.enqueue(f"fast-{i}", model="fast", x=x + i)
        inputs.flush()
        fast = collect(outputs, 40, timeout=60, uris={f"fast-{i}" for i in range(40)})
        assert not any(uri.startswith("slow-") and uri not in refused for uri in fast), "the gate was open"
        gate.touch()
        served = collect(outputs, 0, timeout=60, uris={f"slow-{i}" for i in range(12)} - set(refused))
    for i in range(40):
        np.testing.assert_allclose(fast[f"fast-{i}"]["y"], (x + i) * 2)
    answered = refused | served
    overloaded = {uri for uri, result in answered.items() if uri.startswith("slow-") and result.error_code == "overloaded"}
    assert {f"slow-{i}" for i in range(6, 12)} <= overloaded, "a batch past max_queue_size was not refused"
    for uri in overloaded:
        assert answered[uri]["error"].startswith("model slow version 1 is overloaded: ") and answered[uri].model == "slow"
    for i in range(12):
        if f"slow-{i}" not in overloaded:
            np.testing.assert_allclose(answered[f"slow-{i}"]["y"], (x + i) * 3)
    assert not {f"slow-{i}" for i in range(4)} & overloaded, "refused before max_queue_size requests waited"
    letters = topic_records(config.kafka.bootstrap_servers, config.kafka.dead_letters)
    assert sorted(letter.key.decode() for letter in letters) == sorted(overloaded)
    assert all(dict(letter.headers)["cluster-serving-error-code"] == b"overloaded" for letter in letters)


def test_slow_batches_in_flight_at_checkpoints_survive_a_sigkill_exactly_once(broker, sample_model: Path, tmp_path: Path) -> None:
    root = repository(tmp_path / "models", {
        "preprocess": {"function": "sleep_a_while"}, "batching": {"batch_size": 8, "max_delay_ms": 20},
    }, SLEEPS)
    path = write_run_config(tmp_path, sample_model, broker.bootstrap_servers,
                            models={"repository": str(root), "default": "fast"},
                            kafka={"delivery": "exactly_once", "partitions": 2},
                            batching={"batch_size": 16, "max_delay_ms": 10}, flink={"checkpoint_interval_ms": 500})
    config = load_config(path)
    count = 3000  # a fifth of them slow: its lane is busy at every checkpoint (a batch each 20 ms, 50 ms each)
    requests = [(f"r{i}", "slow" if i % 5 == 0 else "fast", np.full(WIDTH, i, np.float32)) for i in range(count)]
    first = EmbeddedJob(path, config.flink.rest_port, log_path=tmp_path / "job-1.log").start()
    second = StartedByCli(path, config.flink.rest_port, log_path=tmp_path / "job-2.log")
    try:
        producer = ThreadPoolExecutor(max_workers=1).submit(send_paced, config, requests, 500)
        deadline = time.monotonic() + 120
        while not (results_written(config) > count // 3 and results_written(config, "read_committed") > 0) \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        kill_between_checkpoints(first, config)
        assert producer.result() == count
        second.start()
        with OutputQueue(config.kafka.bootstrap_servers, config.kafka.result_topic, group_id=f"{config.kafka.group_id}-client") as outputs:
            results = collect(outputs, count, timeout=240)
            duplicates = outputs.store.duplicates
    finally:
        first.stop()
        second.stop()
    assert "resuming from the retained checkpoint" in second.log_text()
    missing = sorted(set(uri for uri, *_ in requests) - set(results))
    assert not missing, f"{len(missing)} of {count} never answered, e.g. {missing[:5]}"
    assert duplicates == 0 and count_results(config, "read_committed") == count
    assert count_results(config, "read_uncommitted") > count, "nothing was written twice: the kill tested no transaction"
    for uri, model, x in requests:
        np.testing.assert_allclose(results[uri]["y"], x * (3 if model == "slow" else 2))
