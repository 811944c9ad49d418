"""The load of `python -m bench.peers`, run in the peers' environment (.venv-peers): writes COUNT
requests in Seldon MLServer's Kafka format (a JSON InferenceRequest, header mlserver-model, key =
the id) with librdkafka, as fast as it goes, reads the answers from the output topic and prints
one JSON line: answers/s from the first write to the last answer, answers, errors, and requests
never answered (none for 30 s: lost). The same load
for MLServer's Kafka server and for the job. Imports nothing of cluster_serving.

    python bench/peer_drain.py BOOTSTRAP INPUT_TOPIC OUTPUT_TOPIC MODEL COUNT
"""

from __future__ import annotations

import json
import sys
import time
import uuid

import numpy as np

FEATURES = 16
IDLE_S = 30  # no answer for this long: the rest are lost


def drain(bootstrap: str, input_topic: str, output_topic: str, model: str, count: int) -> dict:
    from confluent_kafka import Consumer, Producer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"peer-bench-{uuid.uuid4().hex[:8]}",
                         "enable.auto.commit": False})
    partitions = consumer.list_topics(output_topic, timeout=30).topics[output_topic].partitions
    ends = [consumer.get_watermark_offsets(TopicPartition(output_topic, p), timeout=30)[1] for p in partitions]
    consumer.assign([TopicPartition(output_topic, p, end) for p, end in zip(partitions, ends)])
    rows = np.random.default_rng(0).normal(size=(1000, FEATURES)).astype(np.float32)
    values = [json.dumps({"inputs": [{"name": "features", "shape": [1, FEATURES], "datatype": "FP32",
                                      "data": row.tolist()}]}).encode() for row in rows]
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    headers = [("mlserver-model", model.encode())]
    keys = [f"r{i}".encode() for i in range(count)]
    started = time.perf_counter()
    for i, key in enumerate(keys):
        while True:
            try:
                producer.produce(input_topic, values[i % len(values)], key, headers=headers)
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
    producer.flush()
    answered, errors, last = set(), 0, time.perf_counter()
    while len(answered) < count and time.perf_counter() - last < IDLE_S:
        for record in consumer.consume(1000, 1.0):
            if record.error() is not None:
                continue
            answered.add(record.key())
            errors += b'"error"' in record.value()[:4096]
            last = time.perf_counter()
    consumer.close()
    return {"rate": len(answered) / (last - started), "answered": len(answered), "errors": errors,
            "lost": count - len(answered)}



if __name__ == "__main__":
    bootstrap, input_topic, output_topic, model, count = sys.argv[1:6]
    print(json.dumps(drain(bootstrap, input_topic, output_topic, model, int(count))))
