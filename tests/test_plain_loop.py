"""The benchmark's plain consumer loops (bench/baseline.py), what the job's capacity is compared
with: on a real broker, each answers raw float32 requests with the model's raw results."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from confluent_kafka import Consumer, TopicPartition

from bench.baseline import CLIENTS
from bench.models import bench_models
from bench.kafka_load import ResultReader
from bench.run import DEFAULT_HIDDEN, PLAIN_LOOP_DRAINS, PlainLoop, enqueue_raw, plain_loop_paced, plain_loop_rates
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


def test_the_plain_loop_paced_from_its_start_and_warm_answers_every_request(
    write_config: WriteConfig, tmp_path: Path,
) -> None:
    _, config = write_config()
    model = bench_models(DEFAULT_HIDDEN)["mlp"]
    args = argparse.Namespace(first_minute_seconds=2.0, latency_seconds=1.0)
    figures = plain_loop_paced(config, model, model.samples(8), 500.0, args, tmp_path)
    first, warm = figures["first_minute"], figures["warm"]
    assert (first["requests"], warm["requests"]) == (1000, 500)
    assert first["missing"] == warm["missing"] == 0
    assert first["start_seconds"] > 0
    assert warm["cpu_us_per_request"] > 0  # the loop's process, while it served the warm phase
    assert len(first["windows"]) == 1  # 2 s paced, windows of 10 s
    for phase in (first, warm):
        # The loop's share (the broker's append of a request -> of its result) is within what the reader saw.
        assert 0 <= phase["job_share"]["p50_ms"] <= phase["p50_ms"]
        assert 450 < phase["sent_rate"] < 550
        assert phase["sender_cpu_us_per_request"] > 0


def test_the_librdkafka_loop_also_drains_backlogs_written_in_a_transaction_while_it_runs(
    write_config: WriteConfig, tmp_path: Path,
) -> None:
    _, config = write_config()
    model = bench_models(DEFAULT_HIDDEN)["mlp"]
    warmup, backlog = 2000, 20_000  # results in many produce batches: a drain spans several append stamps
    uris = [f"first-{i}" for i in range(warmup + backlog)]
    rates = plain_loop_rates(config, model, model.samples(8), uris, warmup, tmp_path)
    assert [len(rates[client]) for client in CLIENTS] == [PLAIN_LOOP_DRAINS, 1]
    assert all(rate > 0 for drains in rates.values() for rate in drains)
    # The loop answered the first backlog and each one written (and committed) while it ran.
    reader = ResultReader(config.kafka.bootstrap_servers, f"{config.kafka.result_topic}-plain-{CLIENTS[0]}")
    try:
        assert reader.written() == warmup + backlog * PLAIN_LOOP_DRAINS
    finally:
        reader.close()


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
