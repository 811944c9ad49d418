"""The bridge's Kafka clients: librdkafka (confluent-kafka), as the client library's, where the
start-up checks use kafka-python.

The bridge produces one record per request and reads one result per request, as they come, for
every client of the HTTP API at once, in the process that also parses their HTTP. kafka-python
does a produce request's work in Python, under the GIL the event loop needs; librdkafka does it in
C (docs/development.md, "Dependencies", has the figures).

`kafka.properties` go to librdkafka as they are written (Kafka's dotted names, which librdkafka
shares for the usual security settings: security.protocol, sasl.mechanism, sasl.username, ...).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaException, Producer

from cluster_serving.config import KAFKA_RECORD_BYTES, ConfigError, KafkaConfig
from cluster_serving.kafka.connection import KafkaConnection
from cluster_serving.kafka.librdkafka import LOG_LEVEL, client_settings

log = logging.getLogger("cluster_serving.http.kafka")
# How often the producer's thread serves delivery reports and librdkafka's log lines when idle.
POLL_INTERVAL_S = 0.2


def librdkafka_settings(kafka: KafkaConfig, **settings: Any) -> dict[str, Any]:
    """A bridge client's librdkafka configuration: the broker, kafka.properties, then `settings`."""
    connection = KafkaConnection.of(kafka)
    return client_settings(connection.bootstrap_servers, connection.properties, log,
                           "requests are refused (503) until one is back", **settings)


def client_or_config_error(make: Callable[[], Any], key: str = "kafka.properties") -> Any:
    """What `make` returns, or librdkafka's refusal as one config line about `key`: a property
    it does not know when a client is made, a broker it cannot use when one is asked."""
    try:
        return make()
    except KafkaException as exc:
        raise ConfigError(f"{key}: {exc.args[0].str()}") from None


def check_properties(kafka: KafkaConfig) -> None:
    """ConfigError for a kafka.properties name or value librdkafka refuses: what `start` checks
    before anything runs. The client is made without a broker to reach, so it tries none (and
    reports no failure to reach one before the start's own check of the broker)."""
    client_or_config_error(lambda: Producer({**kafka.properties, "logger": log, "log_level": LOG_LEVEL})).flush(0)


class RequestProducer:
    """Produces requests and reports a failed delivery to the request's own callback.

    librdkafka hands delivery reports over only inside poll(): a thread of ours polls, so that a
    request whose record cannot be written learns it while it waits, not at the next send."""

    def __init__(self, kafka: KafkaConfig, timeout_s: float):
        self._producer: Producer = client_or_config_error(lambda: Producer(librdkafka_settings(
            kafka, **{
                "acks": "all", "linger.ms": 1,
                # librdkafka's 1 MB default would refuse large instances before the job could.
                "message.max.bytes": KAFKA_RECORD_BYTES,
                # A record not written when its request times out is given up with it (librdkafka
                # wants more than linger.ms: at least a second).
                "message.timeout.ms": max(1000, int(timeout_s * 1000)),
            })))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="request-producer", daemon=True)

    def connect(self, topic: str, timeout_s: float) -> None:
        """Waits for the topic's metadata, so that a broker that cannot be used fails the start."""
        client_or_config_error(lambda: self._producer.list_topics(topic, timeout=timeout_s), "kafka.bootstrap_servers")
        self._thread.start()

    def send(self, topic: str, key: bytes, value: bytes, headers: list[tuple[str, bytes]],
             failed: Callable[[str], None]) -> None:
        """Queues one record; `failed(reason)` is called from the polling thread if it is not
        written. Raises BufferError when librdkafka's queue is full."""
        self._producer.produce(topic, value, key, headers=headers,
                               on_delivery=lambda error, _: error is not None and failed(error.str()))

    def close(self, timeout_s: float) -> None:
        """Writes what is queued (up to `timeout_s`), then stops polling."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
        self._producer.flush(timeout_s)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self._producer.poll(POLL_INTERVAL_S)
