"""A producer written against MLServer's Kafka format and one written against Seldon's OIP
protobuf format, with the peers' own libraries (tests/peer_producers.py, in .venv-peers, which
`./run.sh test` makes), get correct answers from a running job with no change but the broker's
address and the topic names; and our client speaks both too."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from confluent_kafka import Producer

from cluster_serving.client import InputQueue, OutputQueue
from cluster_serving.kafka.admin import topic_records
from cluster_serving.ops.sample_model import FEATURES
from tests.conftest import collect
from tests.paths import PROJECT_ROOT

PEERS_PYTHON = PROJECT_ROOT / ".venv-peers" / "bin" / "python"
REQUESTS = 20


def expected(model_path: Path, rows: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: rows})[0]


def test_peer_producers_get_answers(write_config, start_job, tmp_path: Path) -> None:
    assert PEERS_PYTHON.exists(), "no .venv-peers: run the tests with ./run.sh test, which makes it"
    path, config = write_config()
    kafka = config.kafka
    start_job(path, config)
    # Two rows a request: OIP requests carry their batch dimension.
    blocks = np.random.default_rng(7).normal(size=(REQUESTS, 2, FEATURES)).astype(np.float32)
    np.save(tmp_path / "inputs.npy", blocks)
    run = subprocess.run([str(PEERS_PYTHON), str(PROJECT_ROOT / "tests" / "peer_producers.py"), kafka.bootstrap_servers,
                          kafka.input_topic, kafka.result_topic, config.model.name, str(tmp_path / "inputs.npy")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    answers = json.loads(run.stdout.splitlines()[-1])
    want = expected(config.model.path, blocks.reshape(-1, FEATURES)).reshape(REQUESTS, 2, -1)
    for i in range(REQUESTS):
        for kind in ("mlserver", "seldon"):
            answer = answers[f"{kind}-{i}"]
            assert (answer["id"], answer["model"], answer["version"]) == (f"{kind}-{i}", config.model.name, "1")
            (name, values), = answer["outputs"].items()
            assert np.allclose(values, want[i], atol=1e-6), (kind, i)
    assert answers["mlserver-unknown-model"] == {"error_code": "unknown_model", "model": "no-such-model"}
    letters = topic_records(kafka.bootstrap_servers, kafka.dead_letters)
    (letter,) = [letter for letter in letters if letter.key == b"mlserver-unknown-model"]
    assert dict(letter.headers)["mlserver-model"] == b"no-such-model"
    assert dict(letter.headers)["cluster-serving-error-code"] == b"unknown_model"


def test_the_client_speaks_each_protocol(write_config, start_job) -> None:
    """InputQueue(protocol=...) writes each peer's format and OutputQueue reads the answers: a
    batch of rows in, the model's rows out."""
    path, config = write_config()
    kafka = config.kafka
    start_job(path, config)
    rows = np.random.default_rng(3).normal(size=(3, FEATURES)).astype(np.float32)
    want = expected(config.model.path, rows)
    for protocol in ("mlserver", "oip-json", "oip-protobuf", "native"):
        with InputQueue(kafka.bootstrap_servers, kafka.input_topic, protocol=protocol) as inputs:
            inputs.enqueue(f"{protocol}-3", features=rows if protocol != "native" else rows[0])
            inputs.enqueue(f"{protocol}-v1", version=1, features=rows[:1] if protocol != "native" else rows[0])
    # A producer's own: Triton's timeout parameter (microseconds) counts from the record's timestamp.
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers})
    body = {"inputs": [{"name": "features", "shape": [1, FEATURES], "datatype": "FP32", "data": rows[0].tolist()}]}
    for key, timeout, age_s in (("timed-out", 1_000_000, 10), ("in-time", 600_000_000, 10)):
        producer.produce(kafka.input_topic, json.dumps(body | {"parameters": {"timeout": timeout}}).encode(), key.encode(),
                         headers=[("mlserver-model", config.model.name.encode())], timestamp=int((time.time() - age_s) * 1000))
    producer.flush()
    with OutputQueue(kafka.bootstrap_servers, kafka.result_topic, group_id=f"{kafka.group_id}-client") as outputs:
        results = collect(outputs, 10, timeout=60)
    assert results["timed-out"].error_code == "deadline_exceeded"
    assert np.allclose(next(iter(results["in-time"].values())), want[:1], atol=1e-6)
    for protocol in ("mlserver", "oip-json", "oip-protobuf"):
        result = results[f"{protocol}-3"]
        assert (result.model, result.version, result.error_code) == (config.model.name, 1, None)
        assert np.allclose(next(iter(result.values())), want, atol=1e-6)
        assert np.allclose(next(iter(results[f"{protocol}-v1"].values())), want[:1], atol=1e-6)
    assert np.allclose(next(iter(results["native-3"].values())), want[0], atol=1e-6)
