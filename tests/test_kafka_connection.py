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
