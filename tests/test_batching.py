"""The micro-batcher in a running job: the timer flushes a trickle, a burst fills batches, and with
no delay a lone request goes at once while a burst still fills batches."""

from __future__ import annotations

import time

import numpy as np
from kafka import KafkaConsumer

from cluster_serving.client import InputQueue, OutputQueue
from cluster_serving.config.schema import KafkaConfig
from cluster_serving.ops.sample_model import FEATURES
from cluster_serving.wire.codec import decode_message

MAX_DELAY_MS = 500
BATCH_SIZE = 32


def test_trickle_is_flushed_by_the_timer(write_config, start_job) -> None:
    path, config = write_config(batching={"batch_size": BATCH_SIZE, "max_delay_ms": MAX_DELAY_MS})
    start_job(path, config)
    kafka = config.kafka
    latencies = []
    with InputQueue(kafka.bootstrap_servers, kafka.input_topic) as inputs, OutputQueue(
        kafka.bootstrap_servers, kafka.result_topic, group_id=f"{kafka.group_id}-client"
    ) as outputs:
        for i in range(8):
            sent = time.monotonic()
            inputs.enqueue(f"slow-{i}", features=np.ones(FEATURES, np.float32))
            inputs.flush()
            result = outputs.query(f"slow-{i}", timeout=30)
            assert result is not None and "error" not in result
            latencies.append((time.monotonic() - sent) * 1000)
    print(f"trickle latencies (ms): {[round(ms) for ms in latencies]}")
    # Each request waited for the timer (a batch of one never fills), then came straight back.
    assert min(latencies[1:]) >= MAX_DELAY_MS * 0.9
    assert max(latencies[1:]) < MAX_DELAY_MS + 1000


def test_burst_fills_batches(write_config, start_job) -> None:
    path, config = write_config(batching={"batch_size": BATCH_SIZE, "max_delay_ms": MAX_DELAY_MS})
    start_job(path, config)
    count = BATCH_SIZE * 20
    full = burst_in_full_batches(config.kafka, count)
    print(f"burst of {count}: {full} results ran in full batches of {BATCH_SIZE}")
    assert full >= 0.9 * count


def test_no_delay_sends_a_lone_request_at_once_and_batches_a_burst(write_config, start_job) -> None:
    """max_delay_ms 0 waits for no request not yet read (Triton's batcher with no queue delay):
    a lone request goes without waiting for company, and a burst, read together, in full batches,
    not one request at a time."""
    path, config = write_config(batching={"batch_size": BATCH_SIZE, "max_delay_ms": 0})
    start_job(path, config)
    kafka = config.kafka
    with InputQueue(kafka.bootstrap_servers, kafka.input_topic) as inputs, OutputQueue(
        kafka.bootstrap_servers, kafka.result_topic, group_id=f"{kafka.group_id}-client"
    ) as outputs:
        for i in range(3):
            inputs.enqueue(f"lone-{i}", features=np.ones(FEATURES, np.float32))
            inputs.flush()
            result = outputs.query(f"lone-{i}", timeout=30)
            assert result is not None and "error" not in result
    count = BATCH_SIZE * 20
    full = burst_in_full_batches(kafka, count)
    print(f"burst of {count} at max_delay_ms 0: {full} results ran in full batches of {BATCH_SIZE}")
    assert full >= 0.5 * count


def burst_in_full_batches(kafka: KafkaConfig, count: int) -> int:
    """Enqueues `count` requests in one flush, reads every one's result, and counts those that ran
    in a full batch of BATCH_SIZE."""
    with InputQueue(kafka.bootstrap_servers, kafka.input_topic) as inputs:
        for i in range(count):
            inputs.enqueue(f"burst-{i}", features=np.ones(FEATURES, np.float32))
        inputs.flush()
    consumer = KafkaConsumer(
        kafka.result_topic, bootstrap_servers=kafka.bootstrap_servers,
        auto_offset_reset="earliest", consumer_timeout_ms=5000,
    )
    sizes: dict[str, int] = {}
    deadline = time.monotonic() + 60
    for record in consumer:
        message = decode_message(record.value, 1 << 24)
        if message.uri.startswith("burst-"):
            sizes[message.uri] = message.batch_size
        if len(sizes) == count or time.monotonic() > deadline:
            break
    consumer.close()
    assert len(sizes) == count
    return sum(1 for size in sizes.values() if size == BATCH_SIZE)
