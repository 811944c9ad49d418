"""The plain consumer loop: what a user would write in 40 lines instead of the serving job, so the
benchmark can say what Flink, the keyed batcher and checkpoints cost (or buy) on the same backlog.

    python -m bench.baseline --config CONFIG --result-topic TOPIC

It reads every partition of the config's input topic from the start, runs each poll's records as
one batch with the job's session (same model, same device choice, runs of the job's size) and
writes the results, in the job's wire format, to TOPIC, flushing them before the next poll. It
runs until stopped; the benchmark times it by TOPIC's end offsets. It takes its partitions
itself, in no consumer group: kafka-python 3.0.12's group consumer twice spun for good (100% CPU,
in ensure_coordinator_ready, seen with py-spy) after draining part of a bench backlog, and one
backlog read once needs no committed offsets.
"""

from __future__ import annotations

import argparse

from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from cluster_serving.config import KAFKA_RECORD_BYTES, ServingConfig, load_config
from cluster_serving.runtime.model import OnnxModel
from cluster_serving.runtime.preprocess import prepare_values
from cluster_serving.wire.codec import Message, decode_message, encode_message

READY_LINE = "plain loop: consuming "


def serve(config: ServingConfig, result_topic: str) -> None:
    """Poll, decode (images one at a time, as preprocess.images says), stack and run (in runs of
    the job's batching.run_batch_size, as the job's OnnxModel.run_stacked does), encode, produce,
    flush: forever."""
    kafka = config.kafka
    model = OnnxModel(config.model.path, config.device, threads=config.model.threads)
    consumer = KafkaConsumer(
        bootstrap_servers=kafka.bootstrap_servers, auto_offset_reset="earliest", enable_auto_commit=False,
        # kafka-python's 1 MiB per partition holds only 21 requests of 48 KiB, less than a batch;
        # this lets one fetch bring many batches and any record up to the project's limit.
        max_partition_fetch_bytes=KAFKA_RECORD_BYTES,
    )
    partitions = consumer.partitions_for_topic(kafka.input_topic)
    if not partitions:
        raise SystemExit(f"error: plain loop: no topic {kafka.input_topic!r} at {kafka.bootstrap_servers}")
    consumer.assign([TopicPartition(kafka.input_topic, partition) for partition in sorted(partitions)])
    producer = KafkaProducer(
        bootstrap_servers=kafka.bootstrap_servers, acks="all", linger_ms=1, max_request_size=KAFKA_RECORD_BYTES,
    )
    print(f"{READY_LINE}{kafka.input_topic} -> {result_topic} on {model.provider}", flush=True)
    while True:
        records = [r for batch in consumer.poll(timeout_ms=100, max_records=config.batching.batch_size).values()
                   for r in batch]
        if not records:
            continue
        messages = [decode_message(record.value, config.limits.max_instance_bytes) for record in records]
        feeds = [prepare_values(message.tensors, config.preprocess.images, config.limits) for message in messages]
        results = model.run_stacked(feeds, config.batching.run_batch_size)
        for i, message in enumerate(messages):
            tensors = {name: values[i] for name, values in results.items()}
            producer.send(result_topic, key=message.uri.encode(), value=encode_message(Message(message.uri, tensors)))
        producer.flush()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench.baseline", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the job's config: broker, input topic, model, batch size")
    parser.add_argument("--result-topic", required=True, help="where the loop writes its results")
    args = parser.parse_args(argv)
    serve(load_config(args.config), args.result_topic)


if __name__ == "__main__":
    main()
