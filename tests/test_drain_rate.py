"""The benchmark's drain rates (bench/kafka_load.py ResultReader.drain_rate) come from the broker's
append stamps of the results, on a real broker: a reading taken late, on busy cores, no longer
shortens the timed part of a drain."""

from __future__ import annotations

import time

from confluent_kafka import Producer

from bench.kafka_load import ResultReader
from bench.run import BROKER_TIMESTAMPS
from cluster_serving.kafka.admin import ensure_topics
from tests.conftest import WriteConfig

BURST = 2000  # written at once, before the timed part
PACED = 400  # then one every PACE_S
PACE_S = 0.005


def write(producer: Producer, topic: str, first: int, count: int, pause_s: float = 0.0) -> None:
    for i in range(first, first + count):
        producer.produce(topic, b"result", f"uri-{i}".encode())
        if pause_s:
            producer.flush()
            time.sleep(pause_s)
    producer.flush()


def test_a_drain_is_timed_by_its_results_append_stamps_even_when_read_after_it(write_config: WriteConfig) -> None:
    _, config = write_config(kafka={"partitions": 2})
    kafka = config.kafka
    ensure_topics(kafka, topic_configs=BROKER_TIMESTAMPS)
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "linger.ms": 0})
    write(producer, kafka.result_topic, 0, BURST)
    started = time.perf_counter()
    write(producer, kafka.result_topic, BURST, PACED, PACE_S)
    paced_rate = (PACED - 1) / (time.perf_counter() - started)
    reader = ResultReader(kafka.bootstrap_servers, kafka.result_topic)
    try:
        # Everything is on the topic before the first reading: polled end offsets saw no drain at all.
        time.sleep(0.5)
        assert reader.wait_for(BURST + PACED, lambda: True, timeout_s=30)
        rate = reader.drain_rate(BURST, BURST + PACED)
        burst_and_paced = reader.drain_rate(0, BURST + PACED)
        # The topic never holds one more, and the writer is gone: no waiting out the timeout.
        assert not reader.wait_for(BURST + PACED + 1, lambda: False, timeout_s=30)
    finally:
        reader.close()
    # The paced part's own rate, within the broker's millisecond stamps and the writer's pauses.
    assert 0.7 * paced_rate < rate < 1.3 * paced_rate
    assert burst_and_paced > rate  # the burst, appended within milliseconds, counts in its favour
