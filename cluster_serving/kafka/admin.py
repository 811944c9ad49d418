"""Questions to Kafka outside the data path: is the broker reachable, do the topics exist, how
far behind is a consumer group."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import confluent_kafka
import confluent_kafka.admin
from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition
from kafka.admin import NewTopic
from kafka.consumer.fetcher import ConsumerRecord
from kafka.errors import KafkaConfigurationError, KafkaError, TopicAlreadyExistsError

from cluster_serving.config import KAFKA_RECORD_BYTES, ConfigError, KafkaConfig
from cluster_serving.kafka.connection import KafkaConnection
from cluster_serving.kafka.librdkafka import REFUSED_THIS_CLIENT, client_settings, committed_offsets, topic_partitions

log = logging.getLogger(__name__)

# How result readers consume. Under kafka.delivery exactly_once it hides results of transactions
# not committed (yet, or ever: a restart aborts them); without transactions it reads the same as
# read_uncommitted, so readers use it whatever the job's delivery setting is.
READ_COMMITTED = "read_committed"
# How long the lag's questions wait for the broker's answers.
LAG_TIMEOUT_S = 10.0


# Why no broker can be used at an address (broker_problem).
NOTHING_LISTENS = "nothing accepts connections there"
NOT_KAFKA = "something accepts connections there, but no Kafka broker answered"


def unreachable(bootstrap_servers: str, reason: str = NOTHING_LISTENS) -> ConfigError:
    """The one line for a broker that cannot be reached or refuses the configured client, with
    what to do about it."""
    if REFUSED_THIS_CLIENT in reason:
        return ConfigError(f"kafka.properties: {reason}; check the credentials and TLS settings")
    return ConfigError(
        f"kafka.bootstrap_servers: no Kafka broker reachable at {bootstrap_servers} ({reason}); "
        "start one (cluster-serving broker, or start --local-broker) or fix the address"
    )


@contextmanager
def quiet_kafka_logs() -> Iterator[None]:
    """kafka-python logs every failed connection attempt at ERROR (45-121 lines while a client
    bootstraps against a dead address); the caller's one error line says it all."""
    logger = logging.getLogger("kafka")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def quiet_admin_client(timeout_s: float, **properties: Any) -> KafkaAdminClient:
    """An admin client that gives up after `timeout_s` (KafkaError), without kafka-python's lines
    about each failed connection attempt."""
    with quiet_kafka_logs():
        return KafkaAdminClient(
            request_timeout_ms=int(timeout_s * 1000),
            bootstrap_timeout_ms=int(timeout_s * 1000),
            **properties,
        )


def ensure_topics(kafka: KafkaConfig, timeout_s: float = 10.0, topic_configs: Mapping[str, str] | None = None,
                  per_topic: Mapping[str, Mapping[str, str]] | None = None) -> None:
    """Creates the input, result and dead-letter topics when missing (with `topic_configs` added to their
    settings, and `per_topic`'s settings to the topic it names); an unreachable broker, or a listener
    that is not one, is a ConfigError found in seconds (broker_problem) before any Kafka client
    waits `timeout_s` for it."""
    if problem := broker_problem(kafka):
        raise unreachable(kafka.bootstrap_servers, problem)
    try:
        admin = quiet_admin_client(timeout_s, **KafkaConnection.of(kafka).kafka_python())
    except KafkaError as exc:
        raise unreachable(kafka.bootstrap_servers, str(exc)) from None
    try:
        existing = set(admin.list_topics())
        wanted = [kafka.input_topic, kafka.result_topic, *filter(None, [kafka.dead_letters])]
        # Records up to KAFKA_RECORD_BYTES, whatever the broker's own default (Kafka's is 1 MiB).
        settings = {"max.message.bytes": str(KAFKA_RECORD_BYTES), **(topic_configs or {})}
        missing = [NewTopic(topic, kafka.partitions, 1, topic_configs={**settings, **(per_topic or {}).get(topic, {})})
                   for topic in wanted if topic not in existing]
        if missing:
            try:
                admin.create_topics(missing)
                log.info("created topics %s", ", ".join(topic.name for topic in missing))
            except TopicAlreadyExistsError:
                pass
    finally:
        admin.close()


def broker_reachable(bootstrap_servers: str, timeout_s: float = 1.0) -> bool:
    """True when a TCP connection to any bootstrap address opens: a cheap liveness probe that
    needs no Kafka client (whose bootstrap connection closes once it has the cluster's metadata)."""
    for address in bootstrap_servers.split(","):
        host, _, port = address.strip().rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
                return True
        except (OSError, ValueError):
            continue
    return False


def kafka_answers(bootstrap_servers: str, timeout_s: float = 2.0, **properties: Any) -> bool:
    """True when a Kafka broker, not just any listener, answers at the address: a port in use is
    a broker to use only if this holds (`start --local-broker` with the port taken)."""
    try:
        admin = quiet_admin_client(timeout_s, bootstrap_servers=bootstrap_servers, **properties)
    except KafkaConfigurationError as exc:  # the config's mistake, not the broker's
        raise ConfigError(f"kafka.properties: kafka-python, which sets up the topics, refuses them: {exc.args[0] if exc.args else exc}") from None
    except KafkaError:
        return False
    admin.close()
    return True


def broker_problem(kafka: KafkaConfig) -> str | None:
    """Why the configured broker cannot be used (None: it can), asked before anything starts: a
    listener that is not Kafka (a web server on the port, say) passes a TCP probe, and Kafka
    clients then retry for their whole timeout and fail with a bare KafkaTimeoutError."""
    if not broker_reachable(kafka.bootstrap_servers):
        return NOTHING_LISTENS
    if not kafka_answers(**KafkaConnection.of(kafka).kafka_python()):
        return refusal(kafka) or NOT_KAFKA
    return None


def refusal(kafka: KafkaConfig, timeout_s: float = 3.0) -> str | None:
    """Why the broker refuses the configured client (credentials, TLS), in librdkafka's words:
    kafka-python says only that it could not bootstrap. None when it does not refuse it."""
    reasons: list[str] = []
    quiet = logging.getLogger(f"{__name__}.refusal")  # the reason is returned, not logged
    quiet.disabled = True
    admin = confluent_kafka.admin.AdminClient(client_settings(
        kafka.bootstrap_servers, kafka.properties, quiet, "", refused=reasons.append))
    try:
        admin.list_topics(timeout=timeout_s)
    except confluent_kafka.KafkaException:
        admin.poll(0)  # error callbacks are served here
    return reasons[0] if reasons else None


def _partitions(consumer: KafkaConsumer, topic: str) -> list[TopicPartition]:
    return [TopicPartition(topic, pid) for pid in sorted(consumer.partitions_for_topic(topic) or ())]


def log_positions(kafka: KafkaConfig, topic: str, at: int | datetime | None) -> dict[int, int]:
    """Each partition's offset in `topic` at `at`: an int is that offset in every partition (kept
    within the records the partition holds), a datetime the first record written at or after it
    (the end when none), None the end now."""
    consumer = KafkaConsumer(**KafkaConnection.of(kafka).kafka_python())
    try:
        partitions = _partitions(consumer, topic)
        if not partitions:
            raise ConfigError(f"topic {topic!r} does not exist at {kafka.bootstrap_servers}")
        first, ends = consumer.beginning_offsets(partitions), consumer.end_offsets(partitions)
        if at is None:
            found = ends
        elif isinstance(at, datetime):
            times = consumer.offsets_for_times({tp: int(at.timestamp() * 1000) for tp in partitions})
            found = {tp: ends[tp] if times[tp] is None else times[tp].offset for tp in partitions}
        else:
            found = {tp: at for tp in partitions}
        return {tp.partition: min(max(found[tp], first[tp]), ends[tp]) for tp in partitions}
    finally:
        consumer.close()


def end_offsets(bootstrap_servers: str, topic: str, **properties: Any) -> dict[TopicPartition, int]:
    """Each partition's end offset now: where records written after this call will start
    (`properties`: kafka-python's, such as a secured Kafka's)."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap_servers, **properties)
    try:
        return consumer.end_offsets(_partitions(consumer, topic))
    finally:
        consumer.close()


def topic_records(bootstrap_servers: str, topic: str, isolation_level: str = "read_uncommitted", *,
                  since: dict[TopicPartition, int] | None = None, timeout_s: float = 60.0, **properties: Any) -> list[ConsumerRecord]:
    """Every record a reader with that isolation level sees on the topic, all partitions, from
    `since` (end_offsets of an earlier call; None: the start) to the end offsets at this call.
    For inspecting a topic (tests, the bench, replay), not for serving: it holds them all in
    memory. `properties`: kafka-python's, such as a secured Kafka's."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap_servers, isolation_level=isolation_level, **properties)
    try:
        partitions = _partitions(consumer, topic)
        consumer.assign(partitions)
        consumer.seek_to_beginning()
        for partition, offset in (since or {}).items():
            consumer.seek(partition, offset)
        ends, records = consumer.end_offsets(partitions), []
        deadline = time.monotonic() + timeout_s  # a guard against hanging, not a measurement
        while any(consumer.position(tp) < ends[tp] for tp in partitions) and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                records.extend(batch)
        return records
    finally:
        consumer.close()


def records_written(topics: list[str], **properties: Any) -> dict[str, int]:
    """How many records each topic has had: the sum of its partitions' end offsets (one consumer
    made with kafka-python's `properties`, bootstrap_servers among them)."""
    consumer = KafkaConsumer(**properties)
    try:
        return {topic: sum(consumer.end_offsets(_partitions(consumer, topic)).values()) for topic in topics}
    finally:
        consumer.close()


class LagProbe:
    """Measures how many records of `topic` are not yet covered by `group_id`'s committed offsets.
    The serving job commits on checkpoints, so this counts up to one checkpoint interval of
    records more than the job really has left. Keeps one librdkafka consumer, which never joins
    the group; `properties` are Kafka's dotted setting names (a producer's are ignored)."""

    def __init__(self, bootstrap_servers: str, topic: str, group_id: str, properties: Mapping[str, Any] | None = None):
        self.topic = topic
        self._consumer = confluent_kafka.Consumer(client_settings(
            bootstrap_servers, properties or {}, log, "the lag is not known until one is back",
            **{"group.id": group_id, "enable.auto.commit": False},
        ))

    def lag(self) -> int:
        partitions = topic_partitions(self._consumer, self.topic, LAG_TIMEOUT_S)
        if not partitions:
            return 0
        lag = 0
        for partition in committed_offsets(self._consumer, partitions, LAG_TIMEOUT_S):
            start, end = self._consumer.get_watermark_offsets(partition, timeout=LAG_TIMEOUT_S, cached=False)
            lag += end - max(partition.offset, start)  # no commit yet: a negative offset
        return lag

    def close(self) -> None:
        self._consumer.close()


def consumer_lag(bootstrap_servers: str, topic: str, group_id: str, properties: Mapping[str, Any] | None = None) -> int:
    probe = LagProbe(bootstrap_servers, topic, group_id, properties)
    try:
        return probe.lag()
    finally:
        probe.close()
