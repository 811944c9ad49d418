"""One Kafka connection, spelled for each client that reads it."""

from __future__ import annotations

from cluster_serving.config import load_config
from cluster_serving.kafka.connection import KafkaConnection


def test_one_setting_reaches_each_client_in_its_own_spelling() -> None:
    config = load_config(overrides={"kafka.bootstrap_servers": "broker:9093",
                                    "kafka.properties": {"security.protocol": "SSL", "max.partition.fetch.bytes": 1024}})
    connection = KafkaConnection.of(config.kafka)
    assert connection.java({"max.partition.fetch.bytes": "8388608", "linger.ms": "1"}) == {
        "max.partition.fetch.bytes": "1024", "linger.ms": "1", "security.protocol": "SSL"}  # the user's setting wins
    assert connection.kafka_python() == {
        "bootstrap_servers": "broker:9093", "security_protocol": "SSL", "max_partition_fetch_bytes": "1024"}
    assert connection.properties == {"security.protocol": "SSL", "max.partition.fetch.bytes": "1024"}


def test_credentials_and_certificates_are_translated_for_java_and_kafka_python(tmp_path) -> None:
    certificate, key = tmp_path / "client.pem", tmp_path / "client.key"
    certificate.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    key.write_text("-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n")
    secured = {
        "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-256", "sasl.username": "serving",
        "sasl.password": 'pa"ss', "ssl.ca.location": "/etc/kafka/ca.pem",
        "ssl.certificate.location": str(certificate), "ssl.key.location": str(key),
    }
    connection = KafkaConnection("broker:9093", secured)
    assert connection.java() == {
        "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-256",
        "sasl.jaas.config": 'org.apache.flink.kafka.shaded.org.apache.kafka.common.security.scram.ScramLoginModule required username="serving" password="pa\\"ss";',
        "ssl.truststore.type": "PEM", "ssl.truststore.location": "/etc/kafka/ca.pem",
        "ssl.keystore.type": "PEM", "ssl.keystore.certificate.chain": certificate.read_text(),
        "ssl.keystore.key": key.read_text(),
    }
    assert connection.kafka_python() == {
        "bootstrap_servers": "broker:9093", "security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-256",
        "sasl_plain_username": "serving", "sasl_plain_password": 'pa"ss', "ssl_cafile": "/etc/kafka/ca.pem",
        "ssl_certfile": str(certificate), "ssl_keyfile": str(key),
    }
    plain = KafkaConnection("broker:9093", {"sasl.mechanism": "PLAIN", "sasl.username": "u", "sasl.password": "p"})
    assert plain.java()["sasl.jaas.config"] == (
        'org.apache.flink.kafka.shaded.org.apache.kafka.common.security.plain.PlainLoginModule required username="u" password="p";')
    given = KafkaConnection("broker:9093", {"sasl.jaas.config": "org.apache.kafka.common.security.plain.PlainLoginModule required;"})
    assert given.java() == {"sasl.jaas.config": "org.apache.flink.kafka.shaded.org.apache.kafka.common.security.plain.PlainLoginModule required;"}
