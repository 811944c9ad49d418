"""The local broker secured as production Kafka is: TLS on its one client listener, SASL/SCRAM
users, and ACLs enforced by Kafka's StandardAuthorizer (`cluster-serving broker --secure`).

Everything lives in the data folder's `secure/`, made at the first secure start: a local CA and
the broker's certificate (cluster_serving/ops/certificates.py), the users' passwords
(`credentials.yaml`, owner-only) and `client.yaml`, the settings a client of the `serving` user
puts under `kafka.properties`. The users:

    admin      the broker's own (between its listeners) and a super user
    serving    the deployment: the job, bridge, clients, status: every topic, group and transaction
    requester  may write requests to one topic (--request-topic) and nothing else

The controller listener stays on loopback with SASL/PLAIN for admin alone: KRaft cannot check
SCRAM there, since SCRAM users live in the metadata the controller serves.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

import yaml
from confluent_kafka.admin import (
    AclBinding,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
)

from cluster_serving.kafka.connection import KafkaConnection
from cluster_serving.ops.certificates import local_certificates, write_file

MECHANISM = "SCRAM-SHA-256"
USERS = ("admin", "serving", "requester")
SECURE_FOLDER = "secure"
CLIENT_FILE = "client.yaml"


@dataclass(frozen=True)
class BrokerSecurity:
    """The secure/ folder of a broker's data: certificates and passwords."""

    folder: Path
    passwords: dict[str, str]

    @classmethod
    def of(cls, data: Path) -> BrokerSecurity:
        """The data folder's security settings, made on first use."""
        folder = data / SECURE_FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        credentials = folder / "credentials.yaml"
        if not credentials.exists():
            write_file(credentials, yaml.safe_dump({user: secrets.token_urlsafe(24) for user in USERS}).encode(), private=True)
        certificates = local_certificates(folder)
        keystore = folder / "keystore.pem"  # Kafka's PEM keystore: the key, then the certificate
        if not keystore.exists():
            write_file(keystore, certificates.key.read_bytes() + certificates.certificate.read_bytes(), private=True)
        return cls(folder, yaml.safe_load(credentials.read_text()))

    @property
    def ca(self) -> Path:
        return self.folder / "ca.pem"

    def client_properties(self, user: str = "serving") -> dict[str, str]:
        """What a client of `user` sets in kafka.properties (librdkafka's names, translated for the
        other clients by cluster_serving/kafka/connection.py)."""
        return {
            "security.protocol": "SASL_SSL", "sasl.mechanism": MECHANISM, "sasl.username": user,
            "sasl.password": self.passwords[user], "ssl.ca.location": str(self.ca),
        }

    def write_client_file(self) -> Path:
        path = self.folder / CLIENT_FILE
        write_file(path, yaml.safe_dump({"properties": self.client_properties()}, sort_keys=False).encode(), private=True)
        return path

    def server_properties(self, port: int, controller_port: int, loopback: str) -> dict[str, str]:
        """The listeners of a one-node KRaft broker with TLS + SCRAM for clients and ACLs on."""
        admin = self.passwords["admin"]
        return {
            "listeners": f"SASL_SSL://{loopback}:{port},CONTROLLER://{loopback}:{controller_port}",
            "advertised.listeners": f"SASL_SSL://{loopback}:{port}",
            "inter.broker.listener.name": "SASL_SSL",
            "listener.security.protocol.map": "CONTROLLER:SASL_PLAINTEXT,SASL_SSL:SASL_SSL",
            "sasl.enabled.mechanisms": MECHANISM,
            "sasl.mechanism.inter.broker.protocol": MECHANISM,
            "listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config":
                f'org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="{admin}";',
            "sasl.mechanism.controller.protocol": "PLAIN",
            "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
            "listener.name.controller.plain.sasl.jaas.config":
                "org.apache.kafka.common.security.plain.PlainLoginModule required "
                f'username="admin" password="{admin}" user_admin="{admin}";',
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(self.folder / "keystore.pem"),
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(self.ca),
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": "User:admin",
            "allow.everyone.if.no.acl.found": "false",
        }

    def format_arguments(self) -> list[str]:
        """StorageTool's arguments that create the SCRAM users with a new cluster."""
        return [f"--add-scram={MECHANISM}=[name={user},password={password}]" for user, password in self.passwords.items()]

    def grant(self, admin_connection: KafkaConnection, request_topic: str) -> None:
        """The ACLs of `serving` (everything the project does) and `requester` (writing `request_topic`),
        granted over `admin_connection` (the `admin` user's)."""
        admin = AdminClient({"bootstrap.servers": admin_connection.bootstrap_servers, **admin_connection.properties})
        allow = AclPermissionType.ALLOW
        bindings = [
            AclBinding(kind, name, ResourcePatternType.LITERAL, "User:serving", "*", AclOperation.ALL, allow)
            for kind, name in ((ResourceType.TOPIC, "*"), (ResourceType.GROUP, "*"),
                               (ResourceType.TRANSACTIONAL_ID, "*"), (ResourceType.BROKER, "kafka-cluster"))
        ] + [
            AclBinding(ResourceType.TOPIC, request_topic, ResourcePatternType.LITERAL, "User:requester", "*", operation, allow)
            for operation in (AclOperation.WRITE, AclOperation.DESCRIBE)
        ]
        for future in admin.create_acls(bindings, request_timeout=30).values():
            future.result()

