"""The benchmark's plain consumer loops (bench/baseline.py), what the job's capacity is compared
with: on a real broker, each answers raw float32 requests with the model's raw results."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from confluent_kafka import Consumer, TopicPartition

from bench.baseline import CLIENTS
from bench.run import PlainLoop, enqueue_raw
from cluster_serving.kafka.admin import ensure_topics
from cluster_serving.ops.sample_model import FEATURES
from tests.conftest import WriteConfig

REQUESTS = 70  # two full polls of 32 and a short one


@pytest.mark.parametrize("client", CLIENTS)
def test_the_plain_loop_answers_raw_requests_with_raw_results(
    client: str, write_config: WriteConfig, sample_model: Path, tmp_path: Path,
) -> None:
    path, config = write_config()
    kafka = config.kafka
    ensure_topics(kafka)
    samples = np.random.default_rng(5).normal(size=(REQUESTS, FEATURES)).astype(np.float32)
    uris = [f"raw-{i}" for i in range(REQUESTS)]
    enqueue_raw(kafka.bootstrap_servers, kafka.input_topic, uris, samples)
    loop = PlainLoop(path, kafka.input_topic, kafka.result_topic, client, tmp_path / "loop.log")
    loop.start()
    try:
        results = read_results(kafka.bootstrap_servers, kafka.result_topic, REQUESTS)
    finally:
        loop.stop()
    (want,) = ort.InferenceSession(str(sample_model)).run(["probabilities"], {"features": samples})
    assert sorted(results) == sorted(uris)
    for i, uri in enumerate(uris):
        np.testing.assert_allclose(np.frombuffer(results[uri], np.float32), want[i], rtol=1e-5)


def read_results(bootstrap: str, topic: str, count: int, timeout_s: float = 60.0) -> dict[str, bytes]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "plain-loop-test", "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, 0, 0)])
    results: dict[str, bytes] = {}
    try:
        for _ in range(int(timeout_s * 10)):
            for message in consumer.consume(count, 0.1):
                assert message.error() is None
                results[message.key().decode()] = message.value()
            if len(results) >= count:
                break
    finally:
        consumer.close()
    return results
