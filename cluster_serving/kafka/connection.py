"""How every Kafka client of the system reaches the broker, said once: `kafka.bootstrap_servers`
and `kafka.properties` (Kafka's dotted names, security settings among them), spelled for each of
the three clients that read them: Flink's Java connector (the job's source and sink), librdkafka
(the client library, the bridge, the lag probe) and kafka-python (start-up checks, topics, the
repository poller)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cluster_serving.config import KafkaConfig


@dataclass(frozen=True)
class KafkaConnection:
    """librdkafka shares Kafka's dotted names: its clients take `properties` as they are."""

    bootstrap_servers: str
    properties: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, kafka: KafkaConfig) -> KafkaConnection:
        return cls(kafka.bootstrap_servers, dict(kafka.properties))

    def java(self, defaults: Mapping[str, str] | None = None) -> dict[str, str]:
        """The Java connector's properties: `defaults` (the job's tuning), then the user's."""
        return {**(defaults or {}), **self.properties}

    def kafka_python(self) -> dict[str, Any]:
        """kafka-python's keywords: the dotted names with underscores (security.protocol -> security_protocol)."""
        return {"bootstrap_servers": self.bootstrap_servers, **{key.replace(".", "_"): value for key, value in self.properties.items()}}
