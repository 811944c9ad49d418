"""A new JVM's warm-up (flink.warm_up_requests): before the job serves, the same pipeline serves
requests of zeros on topics of its own, so that the JIT has compiled the per-request path (Kafka's
clients, the batcher, the frames, the sink) before the first real request comes, not under it:
first as backlogs (full frames), then paced (a steady load's small frames). The warm-up meets what
the serving job meets, or the JIT throws away its compiled path at the first branch the warm-up
never took: a routing table's control record before each burst, every other burst written in a
Kafka transaction, and topics with the serving topics' timestamp type.
A job restarted in its JVM needs none (docs/operations.md, "A warm-up before the job serves").

This module makes the warm-up's config and feeds it; job/main.py submits and stops its job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from confluent_kafka import Consumer, KafkaException, Producer
from confluent_kafka.admin import AdminClient, ConfigResource

from cluster_serving.config import ServingConfig
from cluster_serving.kafka.connection import KafkaConnection
from cluster_serving.kafka.librdkafka import (
    CONSUMER_DEFAULTS, client_settings, commit_offsets, end_offsets, fetched, paced, produce_waiting,
)
from cluster_serving.runtime.repository import Repository
from cluster_serving.runtime.signature import servable_signature
from cluster_serving.wire.inputs import encode_alike_requests, encode_request
from cluster_serving.wire.tensors import TensorSpec, stacks

log = logging.getLogger("cluster_serving.job")

# Appended to the input and result topics' names and to the group id.
SUFFIX = ".warm-up"
# Each start writes new warm-up records; the broker drops them after ten minutes.
TOPIC_CONFIGS = {"retention.ms": "600000"}
# The serving topics' settings that their warm-up topics copy: Kafka's clients branch on them.
COPIED_SETTINGS = ("message.timestamp.type",)
# The warm-up's requests come in bursts of up to this many, each answered before the next.
BURST = 200_000
# Requests encoded and handed to librdkafka together.
ENCODE_TOGETHER = 1000
# At most this many bytes of requests: the per-request path warms with the count, and a few
# thousand large requests already cost the model far more than the path (docs/operations.md).
MAX_BYTES = 256 << 20
# After the bursts, requests paced at these fractions of the rate the last burst was answered at,
# TAIL_SECONDS each: a job warmed on backlogs alone compiled again for a steady load's smaller
# frames under its first minute of one (docs/benchmarks.md, "A warm-up paced as well").
TAIL_FRACTIONS = (1 / 16, 1 / 8, 1 / 4)
TAIL_SECONDS = 2.0
# Each request's timestamp is this far before its write, in turn: within one Kafka batch their
# timestamp deltas then take one, two and three bytes. The consumer decodes a delta a byte at a time
# and compiled code traps on a longer delta it never met: a real backlog, written more slowly than
# the warm-up's, has them (docs/benchmarks.md, "The first second of a serving job").
TIMESTAMP_OFFSETS_MS = (0, 100, 20_000)
# The second warm-up job starts on a backlog of this many seconds of the last burst's rate.
SECOND_JOB_BACKLOG_S = 0.5
# The warm-up ends after this long, or when its results stop coming for STALLED_S; the job then
# serves whatever is left unanswered of it.
LIMIT_S = 60.0
STALLED_S = 20.0
TIMEOUT_S = 10.0
# How long librdkafka gets to send when its queue is full.
QUEUE_FULL_WAIT_S = 0.05


def warm_up_config(config: ServingConfig, checkpoint_dir: Path) -> ServingConfig:
    """`config` on the warm-up topics, under a group and transactional ids of their own, with no
    dead letters, checkpointing into `checkpoint_dir`."""
    kafka = config.kafka.model_copy(update={
        "input_topic": config.kafka.input_topic + SUFFIX, "result_topic": config.kafka.result_topic + SUFFIX,
        "group_id": config.kafka.group_id + SUFFIX, "dead_letter_topic": "",
    })
    return config.model_copy(update={"kafka": kafka, "flink": config.flink.model_copy(update={"checkpoint_dir": checkpoint_dir})})


def warm_up_topic_settings(config: ServingConfig) -> dict[str, dict[str, str]]:
    """{warm-up topic: COPIED_SETTINGS of the serving topic it stands for}, each set on that topic
    (none where the broker does not say: the warm-up then runs on the broker's defaults)."""
    admin = AdminClient(_settings(config))
    topics = {config.kafka.input_topic: config.kafka.input_topic + SUFFIX, config.kafka.result_topic: config.kafka.result_topic + SUFFIX}
    futures = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, topic) for topic in topics], request_timeout=TIMEOUT_S)
    settings = {}
    for resource, future in futures.items():
        try:
            entries = future.result()
        except KafkaException as exc:
            log.debug("warm-up: the settings of topic %s are not known (%s)", resource.name, exc)
            continue
        settings[topics[resource.name]] = {name: entries[name].value for name in COPIED_SETTINGS
                                           if name in entries and not entries[name].is_default}
    return settings


def zeros_request(repository: Repository) -> dict[str, np.ndarray]:
    """One request of zeros ("" for strings) for the default model's newest version: each input's
    shape with free dimensions 1, without the batch dimension when its instances are stacked."""
    servable = repository.servables[repository.default]
    inputs = servable_signature(repository, servable, max(servable.versions)).inputs
    return {spec.name: _zeros(spec, stacked=stacks(inputs)) for spec in inputs}


def _zeros(spec: TensorSpec, stacked: bool) -> np.ndarray:
    shape = tuple(1 if dim is None else dim for dim in spec.shape[1 if stacked else 0:])
    return np.full(shape, "", dtype=object) if spec.dtype == np.dtype(object) else np.zeros(shape, spec.dtype)


def warm_up_bursts(request: dict[str, np.ndarray], count: int) -> list[range]:
    """The numbers of `count` requests, or of as many as MAX_BYTES holds, in bursts of BURST or fewer."""
    count = min(count, MAX_BYTES // len(encode_request("warm-up", request)))
    return [range(start, min(start + BURST, count)) for start in range(0, count, BURST)]


@contextmanager
def results_awaited(config: ServingConfig) -> Iterator[Callable[[int, float], int]]:
    """A function that waits for `count` results on the warm-up result topic, counted from its end
    as it is now, until a time.monotonic() `deadline`, and returns how many came (fewer when the
    deadline passed or they stopped for STALLED_S)."""
    results = Consumer({**_settings(config), **CONSUMER_DEFAULTS, "group.id": config.kafka.group_id,
                        "enable.auto.commit": False, "isolation.level": "read_committed"})
    try:
        results.assign(end_offsets(results, config.kafka.result_topic, TIMEOUT_S))
        yield lambda count, deadline: _count(results, count, deadline)
    finally:
        results.close()


def paced_tail(first: int, capacity: float) -> list[tuple[range, float]]:
    """The paced requests after the bursts, numbered from `first`: for each of TAIL_FRACTIONS of
    `capacity` (req/s), TAIL_SECONDS of requests and their rate."""
    tail = []
    for fraction in TAIL_FRACTIONS:
        rate = max(1.0, fraction * capacity)
        tail.append((range(first, first := first + max(1, round(rate * TAIL_SECONDS))), rate))
    return tail


def second_job_requests(first: int, capacity: float) -> tuple[range, list[tuple[range, float]]]:
    """The second warm-up job's requests, numbered from `first`: the backlog it meets as it starts
    (SECOND_JOB_BACKLOG_S at `capacity`, in req/s), then the paced ones (paced_tail)."""
    backlog = range(first, first + max(1, round(capacity * SECOND_JOB_BACKLOG_S)))
    return backlog, paced_tail(backlog.stop, capacity)


def skip_earlier_requests(config: ServingConfig) -> None:
    """Commits the warm-up group's offsets at the warm-up input topic's end, so that this warm-up's
    job starts with its own requests, not with the last requests of an earlier warm-up: the group's
    offsets stay where that warm-up job's last checkpoint left them (its final savepoint's commit
    may not reach the broker before the job ends)."""
    consumer = Consumer({**_settings(config), "group.id": config.kafka.group_id, "enable.auto.commit": False})
    try:
        commit_offsets(consumer, end_offsets(consumer, config.kafka.input_topic, TIMEOUT_S), TIMEOUT_S)
    finally:
        consumer.close()


def write_requests(config: ServingConfig, request: dict[str, np.ndarray], numbers: range, rate: float = 0.0,
                   transaction: bool = False) -> None:
    """Copies of `request` on the warm-up input topic, their uris warm-up-<number>, at `rate` per
    second (0: as fast as they go), in one Kafka transaction if asked, timestamped TIMESTAMP_OFFSETS_MS
    before their write in turn. The first burst is written before the warm-up job starts: it meets
    them as a backlog and drains them in full fetches, as it will a real one."""
    transactional = {"transactional.id": f"{config.kafka.group_id}.writer"} if transaction else {}
    producer = Producer({**_settings(config), "linger.ms": 5, **transactional})
    if transaction:
        producer.init_transactions(TIMEOUT_S)
        producer.begin_transaction()
    payloads = _payloads([f"warm-up-{i}" for i in numbers], request)
    for index, (uri, payload) in zip(paced(len(numbers), rate), payloads, strict=True):
        timestamp = round(time.time() * 1000) - TIMESTAMP_OFFSETS_MS[index % len(TIMESTAMP_OFFSETS_MS)]
        produce_waiting(producer, config.kafka.input_topic, payload, uri.encode(), QUEUE_FULL_WAIT_S, timestamp=timestamp)
        producer.poll(0)
    if transaction:
        producer.commit_transaction(TIMEOUT_S)
    producer.flush()


def _payloads(uris: list[str], request: dict[str, np.ndarray]) -> Iterator[tuple[str, bytes]]:
    """(uri, `request` encoded for it), ENCODE_TOGETHER at a time."""
    for start in range(0, len(uris), ENCODE_TOGETHER):
        chunk = uris[start:start + ENCODE_TOGETHER]
        payloads = encode_alike_requests([(uri, request) for uri in chunk]) or [encode_request(uri, request) for uri in chunk]
        yield from zip(chunk, payloads, strict=True)


def _settings(config: ServingConfig) -> dict:
    connection = KafkaConnection.of(config.kafka)
    return client_settings(connection.bootstrap_servers, connection.properties, log, "the warm-up waits")


def _count(results: Consumer, count: int, deadline: float) -> int:
    seen, last = 0, time.monotonic()
    while seen < count and time.monotonic() - last < STALLED_S and time.monotonic() < deadline:
        records = fetched(results, 1.0)
        if records:
            seen, last = seen + len(records), time.monotonic()
    return seen
