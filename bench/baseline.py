"""The plain consumer loop: what a user would write in 40 lines instead of the serving job, so the
benchmark can say what Flink, the micro-batcher and checkpoints cost (or buy) on the same requests.

    python -m bench.baseline --config CONFIG --input-topic RAW --result-topic TOPIC [--client librdkafka]

Requests on RAW are what a user's producer would write: the key is the uri, the value the raw bytes
of the model's one input (float32 in the input's shape, or a JPEG the loop decodes as the config's
`preprocess.images` says). The loop takes up to `batch_size` records at a time, stacks them, runs
them with the job's session settings (provider, threads, no spinning) in runs of the job's
`run_batch_size`, and writes each result (the raw bytes of the first output's row, key = uri) to
TOPIC without waiting for delivery. It runs until stopped; the benchmark times it by TOPIC's end
offsets. Two clients, as users pick them:
- `librdkafka` (confluent-kafka): a consumer group, `poll` for a record, then
  `consume(batch_size - 1, 0)` for those ready behind it (`consume(batch_size, timeout)` alone
  waits out its timeout for a batch that is not full), `produce` + `poll(0)`, librdkafka's
  defaults with `linger.ms` 5 and `fetch.queue.backoff.ms` 10;
- `kafka-python`: the same loop (its `poll` returns the records ready, up to `batch_size`); it
  takes the topic's partitions itself, in no consumer group: kafka-python 3.0.12's group consumer
  twice spun for good (100% CPU in ensure_coordinator_ready, seen with py-spy) partway through a
  backlog.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator

import numpy as np

from cluster_serving.config import KAFKA_RECORD_BYTES, ServingConfig, load_config
from cluster_serving.runtime.model import open_session
from cluster_serving.runtime.preprocess import prepare_values
from cluster_serving.wire.codec import EncodedImage
from cluster_serving.wire.tensors import ONNX_DTYPES

READY_LINE = "plain loop: consuming "
CLIENTS = ("librdkafka", "kafka-python")
LINGER_MS = 5
POLL_TIMEOUT_S = 0.1

# (key, value) of the records one poll returned.
Records = list[tuple[bytes, bytes]]
# Sends one result: (result topic, key, value).
Send = Callable[[str, bytes, bytes], None]


def librdkafka_records(config: ServingConfig, topic: str) -> tuple[Iterator[Records], Send]:
    from confluent_kafka import Consumer, Producer

    from cluster_serving.kafka.librdkafka import fetched

    kafka = config.kafka
    # librdkafka's defaults but one, which its docs suggest lowering when a consumer sees ~1 s delays:
    # after each 100,000 records queued it stopped fetching for a second (docs/benchmarks.md).
    consumer = Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": f"plain-loop-{topic}",
                         "auto.offset.reset": "earliest", "fetch.queue.backoff.ms": 10})
    consumer.subscribe([topic])
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "linger.ms": LINGER_MS,
                         "message.max.bytes": KAFKA_RECORD_BYTES})

    def polls() -> Iterator[Records]:
        while True:
            ready = fetched(consumer, POLL_TIMEOUT_S, behind=config.batching.batch_size - 1)
            yield [(m.key(), m.value()) for m in ready if m.error() is None]

    def send(result_topic: str, key: bytes, value: bytes) -> None:
        while True:
            try:
                producer.produce(result_topic, value, key)
                break
            except BufferError:  # the local queue is full: let deliveries drain it
                producer.poll(POLL_TIMEOUT_S)
        producer.poll(0)

    return polls(), send


def kafka_python_records(config: ServingConfig, topic: str) -> tuple[Iterator[Records], Send]:
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    kafka = config.kafka
    consumer = KafkaConsumer(bootstrap_servers=kafka.bootstrap_servers, auto_offset_reset="earliest",
                             enable_auto_commit=False, max_partition_fetch_bytes=KAFKA_RECORD_BYTES)
    partitions = consumer.partitions_for_topic(topic)
    if not partitions:
        raise SystemExit(f"error: plain loop: no topic {topic!r} at {kafka.bootstrap_servers}")
    consumer.assign([TopicPartition(topic, partition) for partition in sorted(partitions)])
    producer = KafkaProducer(bootstrap_servers=kafka.bootstrap_servers, linger_ms=LINGER_MS,
                             max_request_size=KAFKA_RECORD_BYTES)

    def polls() -> Iterator[Records]:
        while True:
            batches = consumer.poll(timeout_ms=POLL_TIMEOUT_S * 1000, max_records=config.batching.batch_size)
            yield [(r.key, r.value) for batch in batches.values() for r in batch]

    def send(result_topic: str, key: bytes, value: bytes) -> None:
        producer.send(result_topic, key=key, value=value)

    return polls(), send


def serve(config: ServingConfig, input_topic: str, result_topic: str, client: str) -> None:
    """Poll, stack, run, produce: forever."""
    session = open_session(config.model.path, config.device, config.model.threads)
    (node,) = session.get_inputs()
    shape, dtype = tuple(node.shape[1:]), ONNX_DTYPES[node.type]
    image = config.preprocess.images.get(node.name)
    run_size = config.batching.run_batch_size or config.batching.batch_size
    polls, send = (librdkafka_records if client == "librdkafka" else kafka_python_records)(config, input_topic)
    print(f"{READY_LINE}{input_topic} -> {result_topic} on {session.get_providers()[0]} with {client}", flush=True)
    for records in polls:
        if not records:
            continue
        if image is None:
            batch = np.frombuffer(b"".join(value for _, value in records), dtype).reshape(len(records), *shape)
        else:
            batch = np.stack([prepare_values({node.name: EncodedImage(value)}, config.preprocess.images,
                                             config.limits)[node.name] for _, value in records])
        outputs = np.concatenate([session.run(None, {node.name: batch[start:start + run_size]})[0]
                                  for start in range(0, len(batch), run_size)])
        for (key, _), row in zip(records, outputs):
            send(result_topic, key, row.tobytes())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench.baseline", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the job's config: broker, model, batching, threads, images")
    parser.add_argument("--input-topic", required=True, help="where the raw requests are")
    parser.add_argument("--result-topic", required=True, help="where the loop writes its results")
    parser.add_argument("--client", choices=CLIENTS, default=CLIENTS[0])
    args = parser.parse_args(argv)
    serve(load_config(args.config), args.input_topic, args.result_topic, args.client)


if __name__ == "__main__":
    main()
