"""The HTTP bridge over a model repository: real broker, bridge process, real HTTP; a stand-in job.

The repository holds `alpha` (versions 1 and 2, of different input dtypes), `beta` (one version)
and `chain` (a pipeline: alpha's output feeds beta). Most tests' job is a stand-in that reads the request
topic with kafka-python, remembers every record's headers, answers as the job answers (ONNX
Runtime on the version the headers name, the newest when they name none; the job's words for a
model or version it does not serve) and writes results tagged with the model and version; a fake
Flink REST API says the job runs. So these tests pin the bridge's side of the wire: the routes,
the record headers, the answers' model and version, the 404s and the per-model metrics. The
last test runs the real job on the same repository behind the bridge.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import yaml
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from onnx import TensorProto, helper, numpy_helper

from cluster_serving.config import JOB_NAME, ConfigError, ServingConfig, load_config
from cluster_serving.http.catalog import Catalog
from cluster_serving.http.errors import RESULT_ERRORS, ModelNotFound, http_status
from cluster_serving.kafka.admin import ensure_topics
from cluster_serving.ops.children import EmbeddedJob, HttpBridge, LocalBroker
from cluster_serving.ops.processes import free_port, write_run_config
from cluster_serving.runtime.signature import repository_signatures
from cluster_serving.wire.codec import ERROR_CODES, Message, decode_message, encode_message
from tests.conftest import http_call
from tests.onnx_models import graph_model
from tests.stub_http import JsonHandler

F32, F64 = TensorProto.FLOAT, TensorProto.DOUBLE


def elementwise(path: Path, kind: int, op: str, constant: float, names: tuple[str, str]) -> Path:
    """y = x <op> constant over a batch of 3-vectors of `kind`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    dtype = np.float32 if kind == F32 else np.float64
    const = numpy_helper.from_array(np.full(3, constant, dtype), "c")
    node = helper.make_node(op, [names[0], "c"], [names[1]])
    return graph_model(path, [(names[0], kind, [3])], [node], [(names[1], kind, [3])], (const,))


def build_repository(folder: Path) -> Path:
    elementwise(folder / "alpha" / "1" / "model.onnx", F32, "Add", 1.0, ("x", "y"))  # x + 1, float32
    elementwise(folder / "alpha" / "2" / "model.onnx", F64, "Mul", 2.0, ("x", "y"))  # x * 2, float64
    (folder / "alpha" / "servable.yaml").write_text("version_policy: all\n")
    elementwise(folder / "beta" / "1" / "model.onnx", F64, "Mul", 3.0, ("z", "w"))  # z * 3, float64
    (folder / "chain").mkdir()
    (folder / "chain" / "servable.yaml").write_text(yaml.safe_dump({
        "kind": "pipeline",
        "steps": [{"model": "alpha"}, {"model": "beta", "inputs": {"z": "alpha.y"}}],
    }))
    return folder


class FakeFlink(ThreadingHTTPServer):
    """Flink's REST API as the bridge's readiness check asks it: one running serving job."""

    def __init__(self) -> None:
        class Handler(JsonHandler):
            def do_GET(self) -> None:  # noqa: N802
                self.answer({"jobs": [{"jid": "0" * 32, "name": JOB_NAME, "state": "RUNNING", "start-time": 1}]})

        super().__init__(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


@dataclass
class StandInJob:
    """Answers requests as the job does, by the record headers; `serves` is its routing table."""

    config: ServingConfig
    folder: Path
    serves: dict[str, tuple[int, ...]]
    headers: dict[str, dict[str, bytes]] = field(default_factory=dict)  # uri -> its record's headers
    stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> StandInJob:
        kafka = self.config.kafka
        self.consumer = KafkaConsumer(bootstrap_servers=kafka.bootstrap_servers, enable_auto_commit=False)
        partitions = [TopicPartition(kafka.input_topic, p) for p in sorted(self.consumer.partitions_for_topic(kafka.input_topic))]
        self.consumer.assign(partitions)
        self.consumer.seek_to_beginning(*partitions)
        self.producer = KafkaProducer(bootstrap_servers=kafka.bootstrap_servers, linger_ms=1)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.consumer.close()
        self.producer.close(5)

    def _serve(self) -> None:
        while not self.stop.is_set():
            for records in self.consumer.poll(timeout_ms=100).values():
                for record in records:
                    headers = dict(record.headers or [])
                    uri = record.key.decode()
                    self.headers[uri] = headers
                    result = self.answer(decode_message(record.value, 1 << 24), headers)
                    self.producer.send(self.config.kafka.result_topic, key=record.key, value=encode_message(result))
            self.producer.flush()

    def answer(self, request: Message, headers: dict[str, bytes]) -> Message:
        model = headers.get("model", b"").decode() or "alpha"
        if model not in self.serves:
            return Message(request.uri, error=f"unknown model {model!r}; the repository serves {', '.join(sorted(self.serves))}",
                           error_code="unknown_model")
        versions = self.serves[model]
        version = int(headers.get("version", b"0") or 0) or versions[-1]
        if version not in versions:
            served = ", ".join(map(str, versions))
            return Message(request.uri, error=f"model {model!r} has no version {version}; it serves {served}", model=model,
                           error_code="unknown_version")
        inputs = {name: np.asarray(value)[None] for name, value in request.tensors.items()}
        if model == "chain":
            (y,) = self.run("alpha", self.serves["alpha"][-1], inputs)
            outputs = dict(zip(["w"], self.run("beta", 1, {"z": y})))
        else:
            names = ["y"] if model in ("alpha", "gamma") else ["w"]
            outputs = dict(zip(names, self.run(model, version, inputs)))
        return Message(request.uri, {name: value[0] for name, value in outputs.items()}, model=model, model_version=version)

    def run(self, model: str, version: int, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        return ort.InferenceSession(str(self.folder / model / str(version) / "model.onnx")).run(None, inputs)


@dataclass
class Stack:
    url: str
    folder: Path
    job: StandInJob
    request_timeout_s: float

    def last_headers(self) -> dict[str, bytes]:
        """The headers of the last request the bridge sent, but its deadline, which must be the
        bridge's request timeout from when it was sent."""
        headers = dict(self.job.headers[max(self.job.headers, key=lambda uri: int(uri.rsplit("-", 1)[1]))])
        left_ms = int(headers.pop("deadline-ms")) - time.time() * 1000
        assert 0 < left_ms <= self.request_timeout_s * 1000
        return headers


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, broker: LocalBroker, sample_model: Path) -> Iterator[Stack]:
    folder = tmp_path_factory.mktemp("models")
    repository = build_repository(folder / "repository")
    flink = FakeFlink()
    config_path = write_run_config(
        folder, sample_model, broker.bootstrap_servers,
        models={"repository": str(repository), "default": "alpha"}, http={"flink_rest_url": flink.url},
    )
    config = load_config(config_path)
    ensure_topics(config.kafka)
    job = StandInJob(config, repository, {"alpha": (1, 2), "beta": (1,), "chain": (1,)}).start()
    bridge = HttpBridge(config_path, log_path=folder / "bridge.log")
    try:
        bridge.start()
        yield Stack(bridge.url, repository, job, config.http.request_timeout_s)
    finally:
        bridge.stop()
        job.close()
        flink.shutdown()


def answer_after(call: Callable[[], tuple[int, object]], passing: Callable[[int, object], bool]) -> tuple[int, object]:
    """The first answer of `call` that is not `passing` (the bridge's own 404 until its next rescan,
    at most a second away); 200 tries at most."""
    for _ in range(200):
        status, body = call()
        if not passing(status, body):
            break
        time.sleep(0.05)
    return status, body


def v2_request(data: np.ndarray, datatype: str, name: str = "x") -> dict:
    return {"inputs": [{"name": name, "shape": list(data.shape), "datatype": datatype, "data": data.ravel().tolist()}]}


ROWS = np.array([[0.5, 1.5, -2.0], [3.0, 0.25, 4.0]])


def test_the_repository_is_listed(stack: Stack) -> None:
    assert http_call(f"{stack.url}/v1/models") == (200, {"models": ["alpha", "beta", "chain"]})
    assert http_call(f"{stack.url}/v2/models") == (200, [
        {"name": "alpha", "versions": ["1", "2"], "platform": "onnxruntime_onnx"},
        {"name": "beta", "versions": ["1"], "platform": "onnxruntime_onnx"},
        {"name": "chain", "versions": ["1"], "platform": "ensemble"},
    ])
    assert http_call(f"{stack.url}/v2/repository/index", {}) == (200, [
        {"name": "alpha", "version": "1", "state": "READY"},
        {"name": "alpha", "version": "2", "state": "READY"},
        {"name": "beta", "version": "1", "state": "READY"},
        {"name": "chain", "version": "1", "state": "READY"},
    ])


def test_metadata_per_model_and_version(stack: Stack) -> None:
    def metadata(path: str) -> dict:
        status, body = http_call(f"{stack.url}/v2/models/{path}")
        assert status == 200, body
        return body

    newest = metadata("alpha")
    assert newest["versions"] == ["1", "2"] and newest["platform"] == "onnxruntime_onnx"
    assert newest["inputs"] == [{"name": "x", "datatype": "FP64", "shape": [-1, 3]}]
    assert metadata("alpha/versions/2") == newest
    first = metadata("alpha/versions/1")
    assert first["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}]
    assert first["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 3]}]
    chain = metadata("chain")
    assert chain["platform"] == "ensemble" and chain["versions"] == ["1"]
    assert chain["inputs"] == [{"name": "x", "datatype": "FP64", "shape": [-1, 3]}]
    assert chain["outputs"] == [{"name": "w", "datatype": "FP64", "shape": [-1, 3]}]
    assert http_call(f"{stack.url}/v2/models/beta/ready") == (200, {"name": "beta", "ready": True})
    assert http_call(f"{stack.url}/v2/models/alpha/versions/1/ready") == (200, {"name": "alpha", "version": "1", "ready": True})
    assert http_call(f"{stack.url}/v1/models/chain") == (200, {"name": "chain", "ready": True})


NOT_FOUND = "model 'nope' not found; the repository serves alpha, beta, chain"
NO_VERSION = "model 'alpha' has no version 3; it serves 1, 2"


@pytest.mark.parametrize(
    ("route", "body", "message"),
    [
        ("/v2/models/nope", None, NOT_FOUND),
        ("/v2/models/nope/ready", None, NOT_FOUND),
        ("/v2/models/nope/infer", v2_request(ROWS, "FP64"), NOT_FOUND),
        ("/v1/models/nope", None, NOT_FOUND),
        ("/v1/models/nope:predict", {"instances": [{"x": [1.0, 2.0, 3.0]}]}, NOT_FOUND),
        ("/v2/models/alpha/versions/3", None, NO_VERSION),
        ("/v2/models/alpha/versions/3/ready", None, NO_VERSION),
        ("/v2/models/alpha/versions/3/infer", v2_request(ROWS, "FP64"), NO_VERSION),
        ("/v2/models/alpha/versions/latest", None, "model 'alpha' has no version latest; it serves 1, 2"),
        ("/v2/models/chain/versions/2", None, "model 'chain' has no version 2; it serves 1"),
    ],
)
def test_unknown_models_and_versions_are_404_naming_what_is_served(stack: Stack, route: str, body: object, message: str) -> None:
    assert http_call(f"{stack.url}{route}", body) == (404, {"error": message})


def test_requests_carry_model_and_version_as_record_headers(stack: Stack) -> None:
    status, body = http_call(f"{stack.url}/v2/models/alpha/versions/1/infer", {"id": "a1", **v2_request(ROWS, "FP32")})
    assert status == 200, body
    assert (body["model_name"], body["model_version"], body["id"]) == ("alpha", "1", "a1")
    np.testing.assert_allclose(np.array(body["outputs"][0]["data"]).reshape(2, 3), ROWS + 1, rtol=1e-6)
    assert body["outputs"][0]["datatype"] == "FP32"
    assert stack.last_headers() == {"model": b"alpha", "version": b"1"}

    status, body = http_call(f"{stack.url}/v2/models/alpha/infer", v2_request(ROWS, "FP64"))
    assert status == 200, body
    assert (body["model_name"], body["model_version"]) == ("alpha", "2")  # the version that served it
    np.testing.assert_allclose(np.array(body["outputs"][0]["data"]).reshape(2, 3), ROWS * 2)
    assert stack.last_headers() == {"model": b"alpha"}  # no version named: none sent

    status, body = http_call(f"{stack.url}/v1/models/beta:predict", {"instances": [{"z": row.tolist()} for row in ROWS]})
    assert status == 200, body
    np.testing.assert_allclose(np.array(body["predictions"]), ROWS * 3)
    assert stack.last_headers() == {"model": b"beta"}

    status, body = http_call(f"{stack.url}/predict", {"instances": [{"x": ROWS[0].tolist()}]})  # the default model
    assert status == 200, body
    np.testing.assert_allclose(body["predictions"][0], ROWS[0] * 2)
    assert stack.last_headers() == {"model": b"alpha"}

    status, body = http_call(f"{stack.url}/v2/models/chain/versions/1/infer", v2_request(ROWS, "FP64"))
    assert status == 200, body
    assert (body["model_name"], body["model_version"], body["outputs"][0]["name"]) == ("chain", "1", "w")
    np.testing.assert_allclose(np.array(body["outputs"][0]["data"]).reshape(2, 3), ROWS * 6)
    assert stack.last_headers() == {"model": b"chain", "version": b"1"}


def test_json_inputs_are_typed_by_the_version_asked_for(stack: Stack) -> None:
    huge = np.array([[1e39, 0.0, 1.0]])
    status, body = http_call(f"{stack.url}/v2/models/alpha/versions/1/infer", v2_request(huge, "FP64"))
    assert (status, body) == (400, {"error": "input 'x': values outside the range of float32"})
    status, body = http_call(f"{stack.url}/v2/models/alpha/versions/2/infer", v2_request(huge, "FP64"))
    assert status == 200 and body["outputs"][0]["data"] == [2e39, 0.0, 2.0], body
    status, body = http_call(f"{stack.url}/v2/models/alpha/versions/1/infer", v2_request(ROWS, "FP64"))
    assert status == 200 and body["outputs"][0]["datatype"] == "FP32", body
    status, body = http_call(f"{stack.url}/v2/models/beta/infer", v2_request(ROWS.astype(int), "INT64", name="z"))
    assert (status, body) == (400, {"error": "input 'z': expects FP64, got INT64"})


def metrics(url: str) -> dict[str, dict]:
    status, entries = http_call(f"{url}/metrics")
    assert status == 200
    return {entry["name"]: entry for entry in entries}


def test_metrics_per_model_and_version(stack: Stack) -> None:
    before = metrics(stack.url)
    total = before["cluster_serving.http.request"]["count"]
    count = {name: before.get(f"cluster_serving.http.request.{name}", {"count": 0})["count"] for name in ("alpha.1", "beta.1")}
    for _ in range(3):
        assert http_call(f"{stack.url}/v2/models/alpha/versions/1/infer", v2_request(ROWS, "FP32"))[0] == 200
    assert http_call(f"{stack.url}/v1/models/beta:predict", {"instances": [{"z": [1.0, 2.0, 3.0]}]})[0] == 200
    after = metrics(stack.url)
    alpha = after["cluster_serving.http.request.alpha.1"]
    assert (alpha["model"], alpha["version"], alpha["count"] - count["alpha.1"]) == ("alpha", "1", 3)
    assert alpha["max"] >= alpha["median"] > 0
    assert after["cluster_serving.http.request.beta.1"]["count"] - count["beta.1"] == 1
    assert after["cluster_serving.http.request"]["count"] - total == 4  # the total keeps its name
    status, text = http_call(f"{stack.url}/metrics/prometheus")
    assert status == 200
    assert f'cluster_serving_http_model_request_seconds_count{{model="alpha",version="1"}} {alpha["count"]}' in text
    assert text.count("# TYPE cluster_serving_http_model_request_seconds summary") == 1
    assert "cluster_serving_http_request_seconds_count " in text


def test_a_model_added_while_running_is_found_and_the_jobs_refusals_are_404(stack: Stack) -> None:
    """The bridge rescans on a miss; the job, which has not adopted the model yet, answers in its
    own words, which are 404s too, counted as errors of that model."""
    gamma = stack.folder / "gamma"
    elementwise(gamma / "1" / "model.onnx", F32, "Add", 10.0, ("x", "y"))
    route = f"{stack.url}/v2/models/gamma/infer"
    request = v2_request(ROWS, "FP32")
    try:
        status, body = answer_after(
            lambda: http_call(route, request),
            lambda status, body: body == {"error": "model 'gamma' not found; the repository serves alpha, beta, chain"},
        )
        assert (status, body) == (404, {"error": "instance 0: unknown model 'gamma'; the repository serves alpha, beta, chain"})
        assert stack.last_headers() == {"model": b"gamma"}

        stack.job.serves["gamma"] = (1,)
        status, body = http_call(route, request)
        assert status == 200 and body["model_version"] == "1", body
        np.testing.assert_allclose(np.array(body["outputs"][0]["data"]).reshape(2, 3), ROWS + 10, rtol=1e-6)

        (gamma / "servable.yaml").write_text("version_policy: all\n")
        elementwise(gamma / "2" / "model.onnx", F32, "Add", 20.0, ("x", "y"))
        second = f"{stack.url}/v2/models/gamma/versions/2/infer"
        status, body = answer_after(
            lambda: http_call(second, request), lambda status, body: body == {"error": "model 'gamma' has no version 2; it serves 1"}
        )
        assert (status, body) == (404, {"error": "instance 0: model 'gamma' has no version 2; it serves 1"})
        assert metrics(stack.url)["cluster_serving.http.errors.gamma.2"]["count"] == 1
    finally:
        shutil.rmtree(gamma)
        del stack.job.serves["gamma"]


def test_the_repository_is_checked_before_start(tmp_path: Path, sample_model: Path) -> None:
    repository = build_repository(tmp_path / "repository")
    config_path = write_run_config(
        tmp_path, sample_model, "127.0.0.1:9", models={"repository": str(repository), "default": "alpha"}
    )
    config = load_config(config_path)
    _, signatures = repository_signatures(config)
    assert sorted(signatures) == [("alpha", 1), ("alpha", 2), ("beta", 1), ("chain", 1)]
    assert signatures[("alpha", 2)].inputs[0].dtype == np.float64

    (repository / "beta" / "1" / "model.onnx").write_bytes(b"not onnx")
    with pytest.raises(ConfigError, match=r"^models.repository: model 'beta' version 1: cannot load model .*not an ONNX model"):
        repository_signatures(config)
    elementwise(repository / "beta" / "1" / "model.onnx", F64, "Mul", 3.0, ("z", "w"))
    (repository / "beta" / "servable.yaml").write_text("inputs: [q]\n")
    with pytest.raises(ConfigError, match=r"^models.repository: model 'beta' version 1: model.inputs \['q'\] do not match"):
        repository_signatures(config)

    started = subprocess.run(
        [sys.executable, "-m", "cluster_serving.http.server", "--config", str(config_path)], capture_output=True, text=True, timeout=120
    )
    assert started.returncode == 2
    assert started.stderr.strip().splitlines()[-1].startswith("error: models.repository: model 'beta' version 1: model.inputs")


def test_a_rescan_leaves_out_what_cannot_be_read_and_keeps_a_broken_models_last_reading(tmp_path: Path, sample_model: Path) -> None:
    repository = build_repository(tmp_path / "repository")
    config = load_config(write_run_config(
        tmp_path, sample_model, "127.0.0.1:9", models={"repository": str(repository), "default": "alpha"}
    ))
    catalog = Catalog(config)

    def rescan() -> None:
        catalog.read_at = 0.0  # as if the last reading were old
        asyncio.run(catalog.refresh())

    (repository / "beta" / "servable.yaml").write_text("version_policy: all\n")
    (repository / "beta" / "2").mkdir()
    (repository / "beta" / "2" / "model.onnx").write_bytes(b"half a copy")
    (repository / "alpha" / "servable.yaml").write_text("version_policy: [nonsense\n")
    rescan()
    index = catalog.index()
    assert [(entry["name"], entry["version"], entry["state"]) for entry in index] == [
        ("alpha", "1", "READY"), ("alpha", "2", "READY"), ("beta", "1", "READY"), ("beta", "2", "UNAVAILABLE"),
        ("chain", "1", "READY"),
    ]
    assert index[3]["reason"].startswith(
        f"models.repository: model 'beta' version 2: cannot load model {repository / 'beta' / '2' / 'model.onnx'}: not an ONNX model"
    )
    with pytest.raises(ModelNotFound, match="^model 'beta' version 2 is not available: models.repository: "):
        catalog.target("beta", "2")
    assert catalog.target("alpha", "1").signature.inputs[0].datatype == "FP32"  # its last good reading
    assert catalog.target("chain").headers == [("model", b"chain")]

    elementwise(repository / "beta" / "2" / "model.onnx", F64, "Mul", 4.0, ("z", "w"))
    rescan()
    assert catalog.target("beta", "02").headers == [("model", b"beta"), ("version", b"2")]
    assert catalog.target("beta").version is None


def test_the_real_job_serves_each_route_by_the_headers(tmp_path: Path, broker: LocalBroker, sample_model: Path) -> None:
    repository = build_repository(tmp_path / "repository")
    config_path = write_run_config(
        tmp_path, sample_model, broker.bootstrap_servers,
        models={"repository": str(repository), "default": "alpha"}, flink={"checkpoint_interval_ms": 1000},
    )
    job = EmbeddedJob(config_path, load_config(config_path).flink.rest_port, log_path=tmp_path / "job.log")
    bridge = HttpBridge(config_path, log_path=tmp_path / "bridge.log")
    try:
        job.start()
        url = bridge.start().url
        for route, datatype, version, expected in [
            ("alpha/versions/1", "FP32", "1", ROWS + 1),
            ("alpha", "FP64", "2", ROWS * 2),
            ("chain", "FP64", "1", ROWS * 6),
        ]:
            status, body = http_call(f"{url}/v2/models/{route}/infer", v2_request(ROWS, datatype))
            assert status == 200, body
            assert (body["model_name"], body["model_version"]) == (route.split("/")[0], version)
            np.testing.assert_allclose(np.array(body["outputs"][0]["data"]).reshape(2, 3), expected, rtol=1e-6)
        status, body = http_call(f"{url}/v1/models/beta:predict", {"instances": [{"z": ROWS[0].tolist()}]})
        assert status == 200, body
        np.testing.assert_allclose(body["predictions"][0], ROWS[0] * 3)
        status, body = http_call(f"{url}/predict", {"instances": [{"x": ROWS[1].tolist()}]})
        assert status == 200, body
        np.testing.assert_allclose(body["predictions"][0], ROWS[1] * 2)
        assert metrics(url)["cluster_serving.job.inference.alpha.2"]["count"] >= 3
    finally:
        bridge.stop()
        job.stop()


def test_every_error_code_has_its_http_status() -> None:
    """The bridge answers each code the job writes with a status of its own table, none by text."""
    assert set(RESULT_ERRORS) == set(ERROR_CODES)
    assert {code: http_status(RESULT_ERRORS[code]("x")) for code in ERROR_CODES} == {
        "bad_request": 400, "too_large": 413, "unknown_model": 404, "unknown_version": 404,
        "preprocess_failed": 400, "inference_failed": 500, "postprocess_failed": 500, "deadline_exceeded": 504, "overloaded": 503,
        "internal": 500,
    }
