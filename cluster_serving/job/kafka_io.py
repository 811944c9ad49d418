"""Kafka wiring of the Flink job: the request source and the result sink (not named kafka.py: under
`flink run -py cluster_serving/job/main.py` this folder comes first on the path and would hide kafka-python).

Requests arrive as Row(uri, payload, model, version, control, partition, offset, headers)
(job.batch.REQUEST_ROW): the Kafka key is the uri, the value a codec message, the `model` and
`version` headers name what serves it, and a `cluster-serving-control` header marks a routing table
(cluster_serving/job/repository_watch.py). Results and dead letters leave as Row(key, value, headers)
of bytes, headers None for a result. PyFlink (2.2) has no schema that reads keys and headers or
writes Row fields as a record, so two small Java classes (cluster_serving/jvm/java, compiled into the
helper jar) do that.
"""

from __future__ import annotations

from pyflink.common import Types
from pyflink.datastream.connectors.base import DeliveryGuarantee
from pyflink.datastream.connectors.kafka import (
    KafkaOffsetResetStrategy,
    KafkaOffsetsInitializer,
    KafkaSink,
    KafkaSource,
    KafkaTopicPartition,
)
from pyflink.java_gateway import get_gateway

from cluster_serving.config import KAFKA_RECORD_BYTES, KafkaConfig
from cluster_serving.kafka.connection import KafkaConnection

# Row(key, value, headers): the results' and dead letters' element type, the Kafka record's bytes
# (the key the uri's UTF-8), the headers a dead letter's (HeaderBlock.java), None for a result.
RESULT_RECORD = Types.ROW_NAMED(["key", "value", "headers"], [Types.PRIMITIVE_ARRAY(Types.BYTE())] * 3)

# New partitions of the input topic are picked up within 10 s (the connector's default: never).
# Fetches of up to 8 MiB per partition: the default 1 MiB holds 21 requests of 48 KiB, and the
# task thread, busy with a batch's inference, came back to a nearly empty fetch queue. Requests
# written in a Kafka transaction (InputQueue.transaction, an exactly-once upstream job) are served
# once it commits and never if it aborts, as Kafka Streams reads under exactly-once.
SOURCE_PROPERTIES = {"partition.discovery.interval.ms": "10000", "max.partition.fetch.bytes": str(8 << 20),
                     "isolation.level": "read_committed"}
# Results of a millisecond go to the broker in one request of up to 256 KiB: the producer's default
# 16 KiB batch holds only ~150 small results, too few under load. A linger of 1 ms, not Kafka's 5:
# under load a millisecond's results already make a request of tens of KiB, and at a lighter load a
# result waits less (docs/benchmarks.md, "A linger of 1 ms").
# Results up to the project's record limit (the producer's own default is 1 MiB);
# cluster_serving/runtime/encode.py turns a larger one into an error result, so the sink never meets
# a record it must refuse.
SINK_PROPERTIES = {"linger.ms": "1", "batch.size": str(256 << 10), "max.request.size": str(KAFKA_RECORD_BYTES)}
# The logger of every Flink metric group, and the one message of it that drop_committer_gauge_warning drops.
METRIC_GROUP_LOGGER = "org.apache.flink.metrics.MetricGroup"
COMMITTER_GAUGE_COLLISION = r"Name collision: Group already contains a Metric with the name 'pendingCommittables'\..*"


def request_source(kafka: KafkaConfig, control_key: bytes) -> KafkaSource:
    """Reads REQUEST_ROW rows from the input topic, resuming from the group's committed offsets;
    control records are kept only when signed with `control_key` (cluster_serving/job/control_key.py)."""
    builder = _source_builder(kafka).set_starting_offsets(
        KafkaOffsetsInitializer.committed_offsets(KafkaOffsetResetStrategy.EARLIEST))
    builder._j_builder.setDeserializer(get_gateway().jvm.clusterserving.flink.KeyValueDeserializationSchema(control_key.hex()))
    return builder.build()


def replay_source(kafka: KafkaConfig, starts: dict[int, int], stops: dict[int, int],
                  route: tuple[str, str | None] | None) -> KafkaSource:
    """Reads the input topic's records from `starts` to `stops` (partition -> offset) as
    REQUEST_ROW rows, and ends there: a bounded source. Control records are dropped; with a
    `route` (model, version or None), every request is routed to it."""
    builder = (
        _source_builder(kafka)
        .set_starting_offsets(KafkaOffsetsInitializer.offsets(_positions(kafka.input_topic, starts)))
        .set_bounded(KafkaOffsetsInitializer.offsets(_positions(kafka.input_topic, stops)))
    )
    model, version = route or (None, None)
    builder._j_builder.setDeserializer(get_gateway().jvm.clusterserving.flink.KeyValueDeserializationSchema.replaying(model, version))
    return builder.build()


def _source_builder(kafka: KafkaConfig):
    builder = KafkaSource.builder().set_bootstrap_servers(kafka.bootstrap_servers).set_topics(kafka.input_topic).set_group_id(kafka.group_id)
    for key, value in KafkaConnection.of(kafka).java(SOURCE_PROPERTIES).items():
        builder.set_property(key, value)
    return builder


def _positions(topic: str, offsets: dict[int, int]) -> dict[KafkaTopicPartition, int]:
    return {KafkaTopicPartition(topic, partition): offset for partition, offset in offsets.items()}


def drop_committer_gauge_warning() -> None:
    """Keeps the Flink log free of one warning repeated at every checkpoint. Flink 2.2.1's sink
    committer (the Kafka sink's second operator, in both delivery modes) copies its committables
    for each checkpoint, and the copy registers the `pendingCommittables` gauge again (FLINK-35321,
    still so in 2.2.1): the metric group warns "Name collision" each time, while the gauge first
    registered goes on being reported. The cause is in Flink's own operator, so this drops that one
    message with a filter on the metric group's logger, instead of a level that would hide the
    logger's other warnings (a collision among our own metrics, say). It acts on this JVM's
    logging: the embedded MiniCluster's; a Flink cluster's TaskManagers keep their own log config."""
    log4j = get_gateway().jvm.org.apache.logging.log4j
    context = log4j.LogManager.getContext(False)
    configuration = context.getConfiguration()
    result = log4j.core.Filter.Result
    drop = log4j.core.filter.RegexFilter.createFilter(COMMITTER_GAUGE_COLLISION, None, False, result.DENY, result.NEUTRAL)
    logger = configuration.getLoggerConfig(METRIC_GROUP_LOGGER)
    if logger.getName() == METRIC_GROUP_LOGGER:
        logger.addFilter(drop)
    else:  # no logger of its own yet: one that only filters, passing the rest on as before
        logger = (
            log4j.core.config.LoggerConfig.newBuilder().withLoggerName(METRIC_GROUP_LOGGER)
            .withConfig(configuration).withAdditivity(True).withFilter(drop).build()
        )
        configuration.addLogger(METRIC_GROUP_LOGGER, logger)
    context.updateLoggers()


def result_sink(kafka: KafkaConfig) -> KafkaSink:
    """Writes RESULT_RECORD rows, results to the result topic and dead letters to the dead-letter
    topic, at least once, or exactly once in transactions committed with each checkpoint
    (kafka.delivery): one sink, so that a dead letter commits with its error result."""
    schema = get_gateway().jvm.clusterserving.flink.ResultRecordSerializationSchema(kafka.result_topic, kafka.dead_letters)
    builder = KafkaSink.builder().set_bootstrap_servers(kafka.bootstrap_servers)
    # PyFlink's set_record_serializer expects a schema of Flink's own builder (it reads its fields).
    builder._j_builder.setRecordSerializer(schema)
    properties = dict(SINK_PROPERTIES)
    if kafka.exactly_once:
        builder.set_delivery_guarantee(DeliveryGuarantee.EXACTLY_ONCE)
        builder.set_transactional_id_prefix(kafka.transactional_id_prefix)
        properties["transaction.timeout.ms"] = str(kafka.transaction_timeout_ms)
    else:
        builder.set_delivery_guarantee(DeliveryGuarantee.AT_LEAST_ONCE)
    for key, value in KafkaConnection.of(kafka).java(properties).items():
        builder.set_property(key, value)
    return builder.build()
