"""The client side of many models: requests name a model and version in Kafka record headers
(against the real broker), bad names are refused before anything is sent, and results say which
model and version served them."""

from __future__ import annotations

import copy
import http.server
import json
import pickle
import threading
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic

from cluster_serving.client import InputQueue, OutputQueue
from cluster_serving.config import KAFKA_RECORD_BYTES
from cluster_serving.kafka.admin import records_written, topic_records
from cluster_serving.wire.codec import TOP_N_CLASSES, TOP_N_PROBABILITIES, Message, decode_message, encode_message
from cluster_serving.wire.inputs import Result, result_of
from tests.stub_http import JsonHandler

X = np.arange(4, dtype=np.float32)
BAD_MODELS = ["", "a/b", ".hidden", "-x", "with space", "a" * 65, "ünïcode", 3, b"resnet"]
BAD_VERSIONS = [0, -1, True, False, 1.0, np.float64(2), "2", 2**63]


def new_topic(bootstrap: str, partitions: int = 1) -> str:
    topic = f"requests-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, partitions, 1)])
    admin.close()
    return topic


def read_topic(bootstrap: str, topic: str) -> list:
    """Every record of the topic, from the start to its end offset now."""
    records = topic_records(bootstrap, topic)
    written = records_written([topic], bootstrap_servers=bootstrap)[topic]
    assert len(records) == written, f"read {len(records)} of {written} records"
    return records


def headers_by_uri(records: list) -> dict[str, dict[str, bytes]]:
    return {record.key.decode(): dict(record.headers) for record in records}


def test_enqueue_writes_model_and_version_headers(broker) -> None:
    bootstrap = broker.bootstrap_servers
    topic = new_topic(bootstrap)
    with InputQueue(bootstrap, topic) as inputs:
        inputs.enqueue("plain", features=X)
        inputs.enqueue("named", model="resnet", features=X)
        inputs.enqueue("versioned", model="resnet.v2-b_1", version=2, features=X)
        inputs.enqueue("default-model-v3", None, 3, features=X)
        inputs.enqueue("numpy-version", model="m", version=np.int64(12), features=X)
        # Inputs called model and version go through enqueue_batch, whose own keywords name the route.
        count = inputs.enqueue_batch(
            [("batch-0", {"model": X, "version": X + 1}), ("batch-1", {"features": X})],
            model="ranker", version=7,
        )
        assert count == 2
        assert inputs.enqueue_batch([("batch-plain", {"features": X})]) == 1
        inputs.flush()

    records = read_topic(bootstrap, topic)
    assert headers_by_uri(records) == {
        "plain": {},
        "named": {"model": b"resnet"},
        "versioned": {"model": b"resnet.v2-b_1", "version": b"2"},
        "default-model-v3": {"version": b"3"},
        "numpy-version": {"model": b"m", "version": b"12"},
        "batch-0": {"model": b"ranker", "version": b"7"},
        "batch-1": {"model": b"ranker", "version": b"7"},
        "batch-plain": {},
    }
    assert all(record.headers == [] for record in records if record.key in (b"plain", b"batch-plain"))
    # The request bodies are as before: the inputs only, model/version not among them unless so named.
    bodies = {record.key.decode(): decode_message(record.value, KAFKA_RECORD_BYTES) for record in records}
    assert list(bodies["versioned"].tensors) == ["features"]
    assert sorted(bodies["batch-0"].tensors) == ["model", "version"]
    np.testing.assert_array_equal(bodies["batch-0"].tensors["version"], X + 1)


def test_bad_model_or_version_raises_and_sends_nothing(broker) -> None:
    bootstrap = broker.bootstrap_servers
    topic = new_topic(bootstrap)
    with InputQueue(bootstrap, topic) as inputs:
        for model in BAD_MODELS:
            with pytest.raises(ValueError, match="model must be a model repository name"):
                inputs.enqueue("bad-model", model=model, features=X)
            with pytest.raises(ValueError, match="model must be a model repository name"):
                inputs.enqueue_batch([("bad-model-batch", {"features": X})], model=model)
        for version in BAD_VERSIONS:
            with pytest.raises(ValueError, match="version must be a positive integer"):
                inputs.enqueue("bad-version", model="resnet", version=version, features=X)
            with pytest.raises(ValueError, match="version must be a positive integer"):
                inputs.enqueue_batch([("bad-version-batch", {"features": X})], version=version)

        # enqueue_batch refuses before it takes a single request from the iterable.
        def requests() -> Iterator[tuple[str, dict]]:
            raise AssertionError("enqueue_batch read a request despite a bad version")
            yield "never", {}

        with pytest.raises(ValueError):
            inputs.enqueue_batch(requests(), model="resnet", version=0)
        inputs.flush()

        consumer = KafkaConsumer(bootstrap_servers=bootstrap)
        partition = TopicPartition(topic, 0)
        assert consumer.end_offsets([partition])[partition] == 0
        consumer.close()

        # The queue still works afterwards.
        inputs.enqueue("good", model="resnet", version=1, features=X)
        inputs.flush()
    assert headers_by_uri(read_topic(bootstrap, topic)) == {"good": {"model": b"resnet", "version": b"1"}}


def test_result_of_carries_model_and_version() -> None:
    served = result_of(Message("u", {"y": np.ones(2, np.float32)}, model="resnet", model_version=3))
    assert isinstance(served, Result) and isinstance(served, dict)
    assert (served.model, served.version) == ("resnet", 3)
    assert list(served) == ["y"]
    np.testing.assert_array_equal(served["y"], np.ones(2, np.float32))
    assert "model='resnet'" in repr(served) and "version=3" in repr(served)

    error = result_of(Message("u", error="unknown model 'x'; the repository serves a, b", model="x"))
    assert error == {"error": "unknown model 'x'; the repository serves a, b"}  # equal to a plain dict
    assert {"error": "unknown model 'x'; the repository serves a, b"} == error
    assert error.error_code is None  # a job older than error codes
    coded = result_of(Message("u", error="unknown model 'x'; the repository serves a, b", error_code="unknown_model"))
    assert coded.error_code == "unknown_model" and "error_code='unknown_model'" in repr(coded)
    assert (error.model, error.version) == ("x", None)

    top = result_of(Message(
        "u", {TOP_N_CLASSES: np.array([4, 1]), TOP_N_PROBABILITIES: np.array([0.75, 0.25], np.float32)},
        top_n=2, model="classifier", model_version=1,
    ))
    assert top == {4: 0.75, 1: 0.25}
    assert (top.model, top.version) == ("classifier", 1)

    unknown = result_of(Message("u", error="invalid input: x"))
    assert (unknown.model, unknown.version) == (None, None)
    assert repr(unknown) == "{'error': 'invalid input: x'}"

    # Copies and pickles keep what served it; a Result is JSON like the dict it is.
    for again in (copy.copy(top), copy.deepcopy(top), pickle.loads(pickle.dumps(top))):
        assert again == top and (again.model, again.version) == ("classifier", 1)
    assert json.loads(json.dumps(error)) == error


@pytest.mark.parametrize("format_version", [1, 2])
def test_output_queue_results_say_what_served_them(broker, format_version: int) -> None:
    bootstrap = broker.bootstrap_servers
    topic = new_topic(bootstrap, partitions=2)
    messages = [
        Message("r1", {"y": np.zeros(2, np.float32)}, model="resnet", model_version=1),
        Message("r2", {"y": np.ones(2, np.float32)}, model="resnet", model_version=2),
        Message("r3", {"y": np.ones(1, np.float32)}),
        Message("bad", error="model 'resnet' has no version 7; it serves 1, 2", model="resnet"),
    ]
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    for message in messages:
        producer.send(topic, key=message.uri.encode(), value=encode_message(message, format_version))
    producer.flush()
    producer.close()

    with OutputQueue(bootstrap, topic, group_id=f"g-{uuid.uuid4().hex}") as outputs:
        first = outputs.query("r2", timeout=30)
        assert first is not None and (first.model, first.version) == ("resnet", 2)
        results = outputs.dequeue()
    assert {uri: (result.model, result.version) for uri, result in results.items()} == {
        "r1": ("resnet", 1), "r2": ("resnet", 2), "r3": (None, None), "bad": ("resnet", None),
    }
    assert results["bad"] == {"error": "model 'resnet' has no version 7; it serves 1, 2"}
    np.testing.assert_array_equal(results["r2"]["y"], np.ones(2, np.float32))


class _Recorder(JsonHandler):
    paths: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        _Recorder.paths.append(self.path)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.answer({"predictions": [1]})


def test_predict_names_the_model_in_the_v1_route() -> None:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        inputs = InputQueue(sync=True, frontend_url=f"http://127.0.0.1:{server.server_port}/")
        request = {"instances": [{"features": X.tolist()}]}
        assert inputs.predict(request) == [1]
        assert inputs.predict(json.dumps(request), model="resnet") == [1]
        with pytest.raises(ValueError, match="model must be a model repository name"):
            inputs.predict(request, model="../predict")
        with pytest.raises(TypeError):
            inputs.predict(request, version=2)  # type: ignore[call-arg]
    finally:
        server.shutdown()
        server.server_close()
    assert _Recorder.paths == ["/predict", "/v1/models/resnet:predict"]
