"""Kafka load for the benchmark: a paced sender of requests (InputQueue.enqueue, or raw bytes for
the plain loop) and a reader that stamps when each result arrives, both librdkafka clients
(confluent-kafka).

They share the two cores of the development machine with the job they time, so they must cost
little. At 31,000 req/s (half the mlp's capacity there), librdkafka's sender and reader used 0.32
and 0.12 cores; kafka-python's used 0.77 and 0.37 and sent only 27,900 req/s, and the job's share
of the latency rose from p99 20 to 85 ms under the contention."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, Message, Producer, TopicPartition

from cluster_serving.client import DeliveryError, InputQueue
from cluster_serving.client.queues import PRODUCER_SETTINGS
from cluster_serving.config import KAFKA_RECORD_BYTES
from cluster_serving.kafka.librdkafka import (
    CONSUMER_DEFAULTS, PACING_SLEEP_S, end_offsets, fetched, gc_paused, paced, produce_waiting, topic_partitions,
)
from cluster_serving.wire.codec import EncodedImage, decode_message
from cluster_serving.wire.open_inference import decode_answer

# How long the paced sender waits for its last requests to be written.
DELIVERY_TIMEOUT_S = 60.0
METADATA_TIMEOUT_S = 30.0

# A model's sample requests; one requests writer's call sends one of them for a uri.
SampleList = np.ndarray | list[EncodedImage]
SendRequest = Callable[[str, np.ndarray | EncodedImage], None]


@dataclass
class Arrival:
    seconds: float  # time.perf_counter() when the reader got it
    batch_size: int | None
    error: bool
    model: str | None = None  # the model that served it, as its result says
    appended_ms: int = 0  # when the broker appended the result (the bench's topics: LogAppendTime)
    inference_us: int | None = None  # the job's serving stage for the whole batch, as the result says


class ResultReader:
    """Reads a result topic from its start (or, `from_end`, from its end now) and stamps when each
    uri's result arrived: the job's results, or (`raw`) the plain loop's, raw bytes keyed by uri."""

    def __init__(self, bootstrap_servers: str, topic: str, from_end: bool = False, raw: bool = False):
        self.bootstrap_servers, self.topic, self.raw = bootstrap_servers, topic, raw
        self.consumer = Consumer({
            **CONSUMER_DEFAULTS,
            "bootstrap.servers": bootstrap_servers, "group.id": "cs-bench-reader", "enable.auto.commit": False,
            # As kafka-python reads by default, and as the bench read before it moved to librdkafka.
            "isolation.level": "read_uncommitted",
        })
        self.partitions = topic_partitions(self.consumer, topic, METADATA_TIMEOUT_S)
        if not self.partitions:
            raise RuntimeError(f"the broker does not know the result topic {topic!r}")
        start = OFFSET_END if from_end else OFFSET_BEGINNING
        self.consumer.assign([TopicPartition(topic, p.partition, start) for p in self.partitions])
        self.arrivals: dict[str, Arrival] = {}
        self.duplicates = 0

    def end_offsets(self) -> dict[int, int]:
        """Each partition's end offset now, asked again while a topic created a moment ago has no
        leader yet."""
        return {p.partition: p.offset for p in end_offsets(self.consumer, self.topic, METADATA_TIMEOUT_S)}

    def written(self) -> int:
        """Results on the topic now, all partitions (their end offsets)."""
        return sum(self.end_offsets().values())

    def wait_for(self, count: int, alive: Callable[[], bool], timeout_s: float) -> bool:
        """Whether the topic came to hold `count` results within `timeout_s`, while the server was `alive`."""
        deadline = time.monotonic() + timeout_s
        while self.written() < count:
            if time.monotonic() > deadline or not alive():
                return False
            time.sleep(0.02)
        return True

    def drain_rate(self, start: int, end: int) -> float:
        """Results per second from the topic's `start`-th result to its `end`-th, timed by the
        broker's append stamps of the two (the bench's topics: LogAppendTime); NaN within one
        millisecond, or when fewer records hold stamps (transaction markers count in the end
        offsets). The sorted stamps are the topic's count over time by the broker's own clock;
        polled end offsets timed a drain from whenever a reading came through on the busy cores."""
        stamps = self.append_times_ms()
        span_s = (stamps[end - 1] - stamps[start]) / 1000 if len(stamps) >= end else 0.0
        return (end - 1 - start) / span_s if span_s > 0 else float("nan")

    def append_times_ms(self) -> list[int]:
        """When the broker appended each record on the topic now (all partitions), in the order of
        those times, read by a consumer of its own that decodes nothing."""
        consumer = Consumer({"bootstrap.servers": self.bootstrap_servers, "group.id": "cs-bench-stamps",
                             "enable.auto.commit": False, "isolation.level": "read_uncommitted"})
        try:
            ends = self.end_offsets()
            left = {partition for partition, end in ends.items() if end > 0}
            consumer.assign([TopicPartition(self.topic, partition, OFFSET_BEGINNING) for partition in left])
            stamps: list[int] = []
            while left:
                messages = fetched(consumer, 1.0)
                for message in messages:
                    if message.error() is None and message.offset() < ends[message.partition()]:
                        stamps.append(message.timestamp()[1])
                        if message.offset() == ends[message.partition()] - 1:
                            left.discard(message.partition())
                if not messages:  # the last offsets may be transaction markers, never delivered
                    for position in consumer.position([TopicPartition(self.topic, p) for p in left]):
                        if position.offset >= ends[position.partition]:
                            left.discard(position.partition)
            return sorted(stamps)
        finally:
            consumer.close()

    def read_until(self, uris: list[str], timeout: float) -> None:
        """Reads until every uri has its result (or `timeout`)."""
        self.read_pending(self.pending(uris), timeout)

    def pending(self, uris: list[str]) -> set[str]:
        """The uris without a result yet. Made before requests are sent when their latency is timed:
        for millions of uris it takes long enough to hold up the reading of their first results."""
        return set(uris) - self.arrivals.keys()

    def read_pending(self, missing: set[str], timeout: float) -> None:
        """Reads until every uri of `missing` (emptied meanwhile) has its result (or `timeout`). Each
        result is stamped as it comes and decoded afterwards, so decoding does not delay the stamps
        of the ones behind it."""
        received: list[tuple[float, Message]] = []
        deadline = time.monotonic() + timeout
        with gc_paused():
            while missing and time.monotonic() < deadline:
                messages = fetched(self.consumer, 0.1)
                now = time.perf_counter()
                for message in messages:
                    if message.error():
                        raise RuntimeError(f"reading the result topic: {message.error()}")
                    received.append((now, message))
                    missing.discard(message.key().decode())
        for now, message in received:
            self._add(now, message)

    def _add(self, seconds: float, message: Message) -> None:
        appended_ms = message.timestamp()[1]
        if self.raw:
            uri, arrival = message.key().decode(), Arrival(seconds, None, False, appended_ms=appended_ms)
        else:
            result = decode_answer(message.value()) or decode_message(message.value(), KAFKA_RECORD_BYTES)
            uri, arrival = result.uri, Arrival(seconds, result.batch_size, result.error is not None, result.model,
                                               appended_ms, result.inference_us)
        if uri in self.arrivals:
            self.duplicates += 1
        else:
            self.arrivals[uri] = arrival

    def close(self) -> None:
        self.consumer.close()


def paced_sender(bootstrap_servers: str, topic: str, uris: list[str], name: str, samples: SampleList,
                 rate: float, stamps: multiprocessing.Queue, raw: bool = False) -> None:
    """Sends one request per uri (input `name`, cycling through `samples`) at `rate` per second
    with InputQueue.enqueue, or with `raw` as a user's producer writes the plain loop's requests
    (raw_requests); run as a process of its own. Puts (send times in the order of `uris`,
    delivery errors, the CPU seconds it took) on `stamps`: perf_counter is the system's monotonic
    clock, the same in every process. The times go as one array: pickling a dict of a million uris
    took this process a core for 150 ms while the last requests were still in flight, and their
    latency rose to 130 ms."""
    cpu = time.process_time()
    send, flush = raw_requests(bootstrap_servers, topic) if raw else queued_requests(bootstrap_servers, topic, name)
    sent = np.zeros(len(uris))
    try:
        for i in paced(len(uris), rate):
            sent[i] = time.perf_counter()
            send(uris[i], samples[i % len(samples)])
        flush()
        failed = []
    except (DeliveryError, TimeoutError) as exc:
        failed = [str(exc)]
    stamps.put((sent, failed, time.process_time() - cpu))


def queued_requests(bootstrap_servers: str, topic: str, name: str) -> tuple[SendRequest, Callable[[], None]]:
    """(send, flush) of requests through InputQueue.enqueue, the sample as input `name`."""
    inputs = InputQueue(bootstrap_servers, topic)
    return (lambda uri, sample: inputs.enqueue(uri, **{name: sample})), lambda: inputs.flush(DELIVERY_TIMEOUT_S)


def raw_requests(bootstrap_servers: str, topic: str, flush_timeout_s: float = DELIVERY_TIMEOUT_S,
                 transactional_id: str | None = None) -> tuple[SendRequest, Callable[[], None]]:
    """(send, flush) of requests as a user's producer writes them for the plain loop: key the uri,
    value the sample's raw bytes (raw_value), with InputQueue's producer settings; flush waits
    `flush_timeout_s` at most for the ones still queued. With a `transactional_id` all go in one
    Kafka transaction, which flush commits."""
    transactional = {"transactional.id": transactional_id,  # a transaction outlives a record's delivery
                     "transaction.timeout.ms": PRODUCER_SETTINGS["message.timeout.ms"]} if transactional_id else {}
    producer = Producer({**PRODUCER_SETTINGS, **transactional, "bootstrap.servers": bootstrap_servers})
    if transactional_id:
        producer.init_transactions(flush_timeout_s)
        producer.begin_transaction()
    failures: list[str] = []

    def send(uri: str, sample: np.ndarray | EncodedImage) -> None:
        produce_waiting(producer, topic, raw_value(sample), uri.encode(), PACING_SLEEP_S,
                        on_delivery=lambda error, _: failures.append(f"{uri}: {error}") if error else None)
        producer.poll(0)

    def flush() -> None:
        if producer.flush(flush_timeout_s):
            raise TimeoutError(f"requests still unsent to {topic} after {flush_timeout_s:g} s")
        if failures:
            raise DeliveryError(f"{len(failures)} requests not delivered, first {failures[0]}")
        if transactional_id:
            producer.commit_transaction(flush_timeout_s)

    return send, flush


def raw_value(sample: np.ndarray | EncodedImage) -> bytes:
    """A request's value as a user's producer writes it for the plain loop: a tensor's raw bytes, or a JPEG's."""
    return sample.data if isinstance(sample, EncodedImage) else sample.tobytes()
