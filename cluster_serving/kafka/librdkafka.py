"""What every librdkafka (confluent-kafka) client of the project is made with: the broker, the
user's Kafka properties, its log lines sent to a Python logger, and a lost broker told once."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

# Records handed over per fetched() call once the first has come (the rest are already fetched).
CONSUME_BATCH = 1000
# librdkafka's log lines kept: critical and worse. Each failed attempt to reach a broker is an error
# line (syslog level 3), and with the broker gone the bridge's two clients wrote 24 a second.
LOG_LEVEL = 2
# A broker that is not ready yet (its group coordinator loading, a topic just created): asked
# again this often. librdkafka does not call these errors retriable.
NOT_READY_RETRY_S = 0.1
# The broker answers but will not take this client: its credentials or its TLS settings.
REFUSED = {KafkaError._AUTHENTICATION, KafkaError._SSL}
REFUSED_THIS_CLIENT = "refused this client"
# What the project's consumers of records are made with, before the user's properties. librdkafka
# stops fetching a partition for fetch.queue.backoff.ms (1 s by default) once queued.min.messages
# (100,000) wait in its local queue: a reader of a backlog then sat idle most of a second each
# time it had read that many (docs/benchmarks.md, "A plain loop's pause").
CONSUMER_DEFAULTS = {"fetch.queue.backoff.ms": 10}
# A paced writer's shortest sleep (paced()). A sleep costs ~60 us, so one per request fell behind
# at 10k req/s; sleeping at least this long sends the requests that came due meanwhile together, in
# bursts of rate x 1 ms. (Spinning instead took a core of two from the job.)
PACING_SLEEP_S = 0.001
COORDINATOR_NOT_READY = {
    KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError.COORDINATOR_NOT_AVAILABLE,
}
# A topic just created, whose partitions or leaders the broker does not know yet: asked again.
LEADER_NOT_READY = {
    KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.NOT_LEADER_FOR_PARTITION,
}


def client_settings(
    bootstrap_servers: str, properties: Mapping[str, Any], log: logging.Logger, while_down: str,
    refused: Callable[[str], None] | None = None, **settings: Any,
) -> dict[str, Any]:
    """A librdkafka client's configuration: the broker, `properties` (Kafka's dotted names), then
    `settings`. `while_down` says what the client's user sees while no broker is reachable;
    `refused` is told why when the broker refuses the client itself (credentials, TLS)."""
    told_refused = False

    def client_error(error: KafkaError) -> None:
        """librdkafka retries a broker it lost by itself, and reports every failed attempt here
        too: only its word that no broker is left (again every ~10 s while none is), the first
        refusal of this client and fatal errors are logged."""
        nonlocal told_refused
        if error.code() in REFUSED:
            why = f"Kafka at {bootstrap_servers} {REFUSED_THIS_CLIENT}: {error.str()}"
            if not told_refused:
                told_refused = True
                log.error("%s", why)
            if refused is not None:
                refused(why)
        elif error.code() == KafkaError._ALL_BROKERS_DOWN:
            log.error("Kafka at %s: %s; %s", bootstrap_servers, error.str(), while_down)
        elif error.fatal():
            log.error("Kafka at %s: %s", bootstrap_servers, error.str())

    return {"bootstrap.servers": bootstrap_servers, **properties,
            "logger": log, "log_level": LOG_LEVEL, "error_cb": client_error, **settings}


def keyword_settings(keywords: Mapping[str, Any]) -> dict[str, Any]:
    """Python keywords as Kafka's setting names: security_protocol -> security.protocol."""
    return {key.replace("_", "."): value for key, value in keywords.items()}


def produce_waiting(producer: Producer, topic: str, value: bytes, key: bytes, wait_s: float,
                    while_full: Callable[[], None] = lambda: None, **options: Any) -> None:
    """Hands one record to librdkafka; while its queue is full, lets it send for `wait_s` at a time,
    calling `while_full` after each wait (a caller's check that waiting still makes sense)."""
    while True:
        try:
            producer.produce(topic, value, key, **options)
            return
        except BufferError:
            producer.poll(wait_s)
            while_full()


def paced(count: int, rate: float) -> Iterator[int]:
    """0 to count - 1, each once it falls due at `rate` per second (0: all at once), never by a busy
    wait (see PACING_SLEEP_S)."""
    interval = 1.0 / rate if rate else 0.0
    started = time.perf_counter()
    for i in range(count):
        ahead = started + i * interval - time.perf_counter()
        if ahead > 0:
            time.sleep(max(ahead, PACING_SLEEP_S))
        yield i


def fetched(consumer: Consumer, wait_s: float, behind: int = CONSUME_BATCH) -> list[Message]:
    """What the consumer has: up to `wait_s` for the first record, then up to `behind` already
    fetched behind it. consume(n, wait) would wait for all n or the whole wait: every bridge request
    took 201 ms when the result reader used it."""
    first = consumer.poll(wait_s)
    return [] if first is None else [first, *consumer.consume(behind, 0)]


@contextmanager
def gc_paused() -> Iterator[None]:
    """No garbage collection while records are read in bulk and kept: a full collection walks every
    object kept so far, hundreds of thousands of results after a drain, and reading makes no
    cycles for it to find. A collector the caller had turned off stays off."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def topic_partitions(consumer: Consumer, topic: str, timeout_s: float) -> list[TopicPartition]:
    """The topic's partitions in order; none while the broker does not know the topic."""
    metadata = consumer.list_topics(topic, timeout=timeout_s).topics.get(topic)
    if metadata is None or metadata.error is not None:
        return []
    return [TopicPartition(topic, pid) for pid in sorted(metadata.partitions)]


def end_offsets(consumer: Consumer, topic: str, timeout_s: float) -> list[TopicPartition]:
    """Each partition of `topic` at its end (high watermark), asked again while the topic or a
    partition's leader is not known yet, for up to `timeout_s`: a topic created a moment ago
    answered "Not leader for partition"."""

    def ask() -> list[TopicPartition]:
        partitions = topic_partitions(consumer, topic, timeout_s)
        if not partitions:
            raise KafkaException(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART, f"topic {topic!r} is not known to the broker"))
        return [TopicPartition(topic, partition.partition, consumer.get_watermark_offsets(partition, timeout_s)[1])
                for partition in partitions]

    return _asked_again(ask, lambda error: error.code() in LEADER_NOT_READY, timeout_s)


def committed_offsets(consumer: Consumer, partitions: list[TopicPartition], timeout_s: float) -> list[TopicPartition]:
    """The consumer's group's committed offset of each partition (negative where there is none),
    asked again while the broker's group coordinator is still loading (for up to `timeout_s`):
    librdkafka's own question for an assign() gave up on that answer (Not coordinator), and the
    partitions stayed unread."""
    return _coordinator_answer(lambda: consumer.committed(partitions, timeout=timeout_s), timeout_s)


def commit_offsets(consumer: Consumer, offsets: list[TopicPartition], timeout_s: float) -> None:
    """Commits `offsets` for the consumer's group, asked again while its coordinator is still
    loading (for up to `timeout_s`)."""
    _coordinator_answer(lambda: consumer.commit(offsets=offsets, asynchronous=False), timeout_s)


def _coordinator_answer(ask: Callable[[], list[TopicPartition]], timeout_s: float) -> list[TopicPartition]:
    """What `ask` answers once no partition of it has an error, asked again while the error is
    retriable or the group coordinator is not ready, for up to `timeout_s`."""

    def answer() -> list[TopicPartition]:
        partitions = ask()
        if error := next((partition.error for partition in partitions if partition.error), None):
            raise KafkaException(error)
        return partitions

    return _asked_again(answer, lambda error: error.retriable() or error.code() in COORDINATOR_NOT_READY, timeout_s)


def _asked_again(ask: Callable[[], list[TopicPartition]], not_ready: Callable[[KafkaError], bool],
                 timeout_s: float) -> list[TopicPartition]:
    """What `ask` answers, asked again every NOT_READY_RETRY_S while the error it raises is one that
    `not_ready` says will pass, for up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ask()
        except KafkaException as exc:
            if not not_ready(exc.args[0]) or time.monotonic() >= deadline:
                raise
        time.sleep(NOT_READY_RETRY_S)
