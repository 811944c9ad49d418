"""How every Kafka client of the system reaches the broker, said once: `kafka.bootstrap_servers`
and `kafka.properties`, spelled for each of the three clients that read them: librdkafka (the
client library, the bridge, the lag probe), Flink's Java connector (the job's source and sink) and
kafka-python (start-up checks, topics, the repository poller).

`kafka.properties` are written in librdkafka's names, which are Kafka's where the two agree. The
security settings that they spell differently are translated here, and only here:

    sasl.username, sasl.password    Java: sasl.jaas.config (the login module of sasl.mechanism, in
                                    the connector jar's relocated package, as a given one is put)
                                    kafka-python: sasl_plain_username, sasl_plain_password
    ssl.ca.location                 Java: a PEM truststore; kafka-python: ssl_cafile
    ssl.certificate.location,       Java: a PEM keystore (the files' contents);
    ssl.key.location                kafka-python: ssl_certfile, ssl_keyfile

Any other name goes to each client as it is (kafka-python's with underscores for dots), so a
setting only one client knows can still be given in that client's spelling.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster_serving.config import KafkaConfig

# The job's connector jar carries the Kafka client relocated under this package, its login
# modules included: a JAAS config must name them there.
KAFKA_PACKAGE = "org.apache.kafka."
SHADED_KAFKA_PACKAGE = "org.apache.flink.kafka.shaded.org.apache.kafka."
LOGIN_MODULES = {
    "PLAIN": "common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "common.security.scram.ScramLoginModule",
}
KAFKA_PYTHON_NAMES = {
    "sasl.username": "sasl_plain_username",
    "sasl.password": "sasl_plain_password",
    "ssl.ca.location": "ssl_cafile",
    "ssl.certificate.location": "ssl_certfile",
    "ssl.key.location": "ssl_keyfile",
    "ssl.key.password": "ssl_password",
}
# The names the Java client spells otherwise.
TRANSLATED_FOR_JAVA = frozenset(KAFKA_PYTHON_NAMES)


@dataclass(frozen=True)
class KafkaConnection:
    """librdkafka takes `properties` as they are; java() and kafka_python() translate them."""

    bootstrap_servers: str
    properties: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, kafka: KafkaConfig) -> KafkaConnection:
        return cls(kafka.bootstrap_servers, dict(kafka.properties))

    def java(self, defaults: Mapping[str, str] | None = None) -> dict[str, str]:
        """The Java connector's properties: `defaults` (the job's tuning), then the user's, translated."""
        given = dict(self.properties)
        java = {key: value for key, value in given.items() if key not in TRANSLATED_FOR_JAVA}
        if "sasl.username" in given and "sasl.jaas.config" not in given:
            module = LOGIN_MODULES.get(given.get("sasl.mechanism", "PLAIN").upper(), LOGIN_MODULES["PLAIN"])
            java["sasl.jaas.config"] = (
                f'{SHADED_KAFKA_PACKAGE}{module} required username="{_quoted(given["sasl.username"])}" '
                f'password="{_quoted(given.get("sasl.password", ""))}";'
            )
        elif given.get("sasl.jaas.config", "").startswith(KAFKA_PACKAGE):
            java["sasl.jaas.config"] = SHADED_KAFKA_PACKAGE + given["sasl.jaas.config"].removeprefix(KAFKA_PACKAGE)
        if "ssl.ca.location" in given:
            java |= {"ssl.truststore.type": "PEM", "ssl.truststore.location": given["ssl.ca.location"]}
        if "ssl.certificate.location" in given and "ssl.key.location" in given:
            java |= {
                "ssl.keystore.type": "PEM",
                "ssl.keystore.certificate.chain": Path(given["ssl.certificate.location"]).read_text(),
                "ssl.keystore.key": Path(given["ssl.key.location"]).read_text(),
            }
            if "ssl.key.password" in given:
                java["ssl.key.password"] = given["ssl.key.password"]
        return {**(defaults or {}), **java}

    def kafka_python(self) -> dict[str, Any]:
        """kafka-python's keywords: translated names, the rest with underscores (security.protocol -> security_protocol)."""
        return {"bootstrap_servers": self.bootstrap_servers, **{
            KAFKA_PYTHON_NAMES.get(key, key.replace(".", "_")): value for key, value in self.properties.items()
        }}


def _quoted(text: str) -> str:
    """A value inside a JAAS config's double quotes."""
    return text.replace("\\", "\\\\").replace('"', '\\"')
