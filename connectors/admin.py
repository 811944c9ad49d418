"""Start-up checks against Kafka: is the broker reachable, do the topics exist."""

from __future__ import annotations

import logging
import socket

from kafka import KafkaAdminClient
from kafka.admin import NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError

from conf import ConfigError, KafkaConfig

log = logging.getLogger(__name__)


def client_properties(kafka: KafkaConfig) -> dict[str, str]:
    """kafka.properties in kafka-python's spelling (security.protocol -> security_protocol)."""
    return {key.replace(".", "_"): value for key, value in kafka.properties.items()}


def ensure_topics(kafka: KafkaConfig, timeout_s: float = 10.0) -> None:
    """Creates the input and result topics when missing; an unreachable broker is a ConfigError."""
    try:
        admin = KafkaAdminClient(
            bootstrap_servers=kafka.bootstrap_servers,
            request_timeout_ms=int(timeout_s * 1000),
            bootstrap_timeout_ms=int(timeout_s * 1000),
            **client_properties(kafka),
        )
    except KafkaError as exc:
        raise ConfigError(
            f"kafka.bootstrap_servers: no Kafka broker reachable at {kafka.bootstrap_servers} ({exc})"
        ) from None
    try:
        existing = set(admin.list_topics())
        wanted = [kafka.input_topic, kafka.result_topic]
        missing = [NewTopic(topic, kafka.partitions, 1) for topic in wanted if topic not in existing]
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
