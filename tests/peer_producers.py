"""Producers and consumers as users of the peers write them, run in the peers' own environment
(.venv-peers: MLServer 1.7.1 and its dependencies, kafka-python): MLServer's Kafka format built
with MLServer's request types and codecs, and Seldon Core 2's protobuf format with the v2 dataplane
messages Seldon generates (mlserver.grpc.dataplane_pb2). Nothing of cluster_serving is imported.

    python tests/peer_producers.py BOOTSTRAP INPUT_TOPIC RESULT_TOPIC MODEL INPUTS.npy

Sends each row block of INPUTS (float32, shape (requests, rows, features)) once in each format,
reads every answer and prints one JSON object: per request id, the outputs as parsed by the peer's
own classes (or the error), with the model name and version the answer gives.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from kafka import KafkaConsumer, KafkaProducer
from mlserver.codecs import NumpyCodec
from mlserver.grpc import dataplane_pb2
from mlserver.types import InferenceRequest, InferenceResponse


def mlserver_record(request_id: str, rows: np.ndarray, model: str) -> tuple[bytes, bytes, list]:
    request = InferenceRequest(inputs=[NumpyCodec.encode_input("features", rows)])
    headers = [("mlserver-model", model.encode())]
    return request_id.encode(), request.model_dump_json(exclude_none=True).encode(), headers


def seldon_record(request_id: str, rows: np.ndarray) -> tuple[bytes, bytes, list]:
    request = dataplane_pb2.ModelInferRequest(id=request_id)
    request.inputs.add(name="features", datatype="FP32", shape=list(rows.shape))
    request.raw_input_contents.append(rows.astype("<f4").tobytes())
    return request_id.encode(), request.SerializeToString(), [("seldon-infer-type", b"proto/InferModelRequest")]


def parsed(value: bytes) -> dict:
    """An answer as the peer's own classes read it."""
    if value[:1] == b"{":
        body = json.loads(value)
        if "error" in body:
            return {"error_code": body.get("error_code"), "model": body.get("model_name")}
        response = InferenceResponse.model_validate(body)
        outputs = {out.name: NumpyCodec.decode_output(out).tolist() for out in response.outputs}
        return {"outputs": outputs, "model": response.model_name, "version": response.model_version, "id": response.id}
    response = dataplane_pb2.ModelInferResponse.FromString(value)
    outputs = {out.name: np.frombuffer(raw, "<f4").reshape(list(out.shape)).tolist()
               for out, raw in zip(response.outputs, response.raw_output_contents)}
    return {"outputs": outputs, "model": response.model_name, "version": response.model_version, "id": response.id}


def main(bootstrap: str, input_topic: str, result_topic: str, model: str, inputs_path: str) -> None:
    blocks = np.load(inputs_path)
    records = [mlserver_record(f"mlserver-{i}", block, model) for i, block in enumerate(blocks)]
    records += [seldon_record(f"seldon-{i}", block) for i, block in enumerate(blocks)]
    records.append(mlserver_record("mlserver-unknown-model", blocks[0], "no-such-model"))
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    for key, value, headers in records:
        producer.send(input_topic, value=value, key=key, headers=headers)
    producer.flush()
    wanted = {key.decode() for key, _, _ in records}
    consumer = KafkaConsumer(result_topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             consumer_timeout_ms=1000)
    answers, deadline = {}, time.monotonic() + 120
    while set(answers) < wanted and time.monotonic() < deadline:
        for record in consumer:
            key = record.key.decode()
            if key in wanted:
                answers[key] = parsed(record.value)
    print(json.dumps(answers))


if __name__ == "__main__":
    main(*sys.argv[1:])
