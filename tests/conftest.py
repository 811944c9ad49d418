"""Shared fixtures: one local Kafka broker per test session, configs with their own topics,
and embedded jobs that are always stopped, also when a test fails."""

from __future__ import annotations

import json
import re
import signal
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from cluster_serving.client import InputQueue, OutputQueue
from cluster_serving.config import ServingConfig, load_config
from cluster_serving.ops.children import EmbeddedJob, LocalBroker
from cluster_serving.ops.processes import free_port, write_run_config
from cluster_serving.ops.sample_model import FEATURES, build_sample_model


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBroker]:
    folder = tmp_path_factory.mktemp("broker")
    local = LocalBroker(folder / "kafka", port=free_port(), log_path=folder / "broker.log")
    local.start()
    yield local
    local.stop()


@pytest.fixture(scope="session")
def sample_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sample_model(tmp_path_factory.mktemp("model") / "model.onnx")


WriteConfig = Callable[..., tuple[Path, ServingConfig]]


@pytest.fixture
def write_config(tmp_path: Path, broker: LocalBroker, sample_model: Path) -> WriteConfig:
    """Writes a config with fresh topic names, group id and REST port; keyword sections override."""

    def write(**sections: dict) -> tuple[Path, ServingConfig]:
        flink = {"checkpoint_interval_ms": 1000, **sections.pop("flink", {})}
        path = write_run_config(tmp_path, sample_model, broker.bootstrap_servers, flink=flink, **sections)
        return path, load_config(path)

    return write


@pytest.fixture
def start_job(tmp_path: Path) -> Iterator[Callable[[Path, ServingConfig], EmbeddedJob]]:
    """Starts embedded jobs and stops every one of them at teardown."""
    started: list[EmbeddedJob] = []

    def start(path: Path, config: ServingConfig) -> EmbeddedJob:
        job = EmbeddedJob(path, config.flink.rest_port, log_path=tmp_path / f"job-{len(started)}.log")
        started.append(job)
        job.start()
        return job

    yield start
    for job in started:
        job.stop()


def interrupted_once_logged(job: EmbeddedJob, pattern: str, timeout: float = 120) -> int:
    """Spawns `job`, sends its process SIGINT (Ctrl-C) the moment its log matches `pattern`, and
    returns its exit code; the job's log stays readable."""
    job.spawn()
    assert job.process is not None
    try:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, job.log_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
        job.process.send_signal(signal.SIGINT)
        return job.process.wait(timeout)
    finally:
        job.stop()


def collect(outputs: OutputQueue, count: int, timeout: float, uris: set[str] | None = None) -> dict[str, dict]:
    """dequeue() until `count` results are in (or, given `uris`, those uris' results, whatever
    else comes) or `timeout` passes; a uri twice is a failure."""
    results: dict[str, dict] = {}
    deadline = time.monotonic() + timeout
    while (len(results) < count if uris is None else not uris <= results.keys()) and time.monotonic() < deadline:
        batch = outputs.dequeue()
        assert not set(batch) & set(results), "a uri came back twice from dequeue()"
        results.update(batch)
        if not batch:
            time.sleep(0.2)
    return results


def assert_served(config: ServingConfig, count: int, seed: int, timeout: float) -> None:
    """Sends `count` sample-model requests through the client library and checks that every uri
    gets exactly one result equal to ONNX Runtime run directly on the same input."""
    features = np.random.default_rng(seed).normal(size=(count, FEATURES)).astype(np.float32)
    kafka = config.kafka
    with InputQueue(kafka.bootstrap_servers, kafka.input_topic) as inputs, OutputQueue(
        kafka.bootstrap_servers, kafka.result_topic, group_id=f"{kafka.group_id}-client"
    ) as outputs:
        for i in range(count):
            inputs.enqueue(f"req-{i}", features=features[i])
        inputs.flush()
        results = collect(outputs, count, timeout)
        assert outputs.store.duplicates == 0

    assert sorted(results) == sorted(f"req-{i}" for i in range(count))
    expected = ort.InferenceSession(str(config.model.path)).run(None, {"features": features})[0]
    for i in range(count):
        result = results[f"req-{i}"]
        assert "error" not in result, result
        np.testing.assert_allclose(result["probabilities"], expected[i], atol=1e-5)


def http_call(
    url: str, body: object = None, headers: dict[str, str] | None = None, context: ssl.SSLContext | None = None
) -> tuple[int, object]:
    """GET (no body) or POST (a str as it is, anything else as JSON); returns the status and the
    parsed JSON answer (text when it is not JSON). Error statuses are answers, not exceptions.
    `context`: what an https URL is checked with."""
    data = None if body is None else (body if isinstance(body, str) else json.dumps(body)).encode()
    request = urllib.request.Request(url, data=data, headers=headers or {}, method="GET" if data is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=60, context=context) as response:
            status, payload = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, payload = error.code, error.read()
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, payload.decode(errors="replace")
