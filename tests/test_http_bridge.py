"""The HTTP bridge over real parts: broker process, embedded PyFlink job, bridge process, real HTTP.

One job serves the sample model for the whole module; bridges with other settings (token, rate
limit, tiny timeout, no Flink to ask) run beside the main one against the same job and topics.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from email.message import Message
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import yaml

from cluster_serving.client import InputQueue, PredictError
from cluster_serving.config import load_config
from cluster_serving.http.server import listen
from cluster_serving.ops.certificates import local_certificates
from cluster_serving.ops.children import EmbeddedJob, HttpBridge, LocalBroker
from cluster_serving.ops.operations import bridge_state
from cluster_serving.ops.processes import free_port, write_run_config
from cluster_serving.ops.sample_model import FEATURES
from tests.conftest import http_call

TOKEN = "test-token-5f1c"


class Stack:
    """The module's job and main bridge, and a way to start more bridges on the same topics."""

    def __init__(self, folder: Path, config_path: Path, job: EmbeddedJob, bridge: HttpBridge):
        self.folder, self.config_path, self.job, self.bridge = folder, config_path, job, bridge
        self.url = bridge.url
        self.config = load_config(config_path)
        self.session = ort.InferenceSession(str(self.config.model.path))
        self.extra: list[HttpBridge] = []

    def expected(self, features: np.ndarray) -> np.ndarray:
        return self.session.run(None, {"features": features.astype(np.float32)})[0]

    def another_bridge(self, **http: object) -> str:
        """A bridge with `http` settings changed, reading the same job's topics; stopped at the end."""
        raw = yaml.safe_load(self.config_path.read_text())
        raw["http"] = {**raw.get("http", {}), "port": free_port(), **http}
        path = self.folder / f"bridge-{len(self.extra)}.yaml"
        path.write_text(yaml.safe_dump(raw))
        bridge = HttpBridge(path, log_path=self.folder / f"bridge-{len(self.extra)}.log")
        self.extra.append(bridge)
        return bridge.start().url


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, broker: LocalBroker, sample_model: Path) -> Iterator[Stack]:
    folder = tmp_path_factory.mktemp("http")
    config_path = write_run_config(
        folder, sample_model, broker.bootstrap_servers,
        flink={"checkpoint_interval_ms": 1000},
    )
    job = EmbeddedJob(config_path, load_config(config_path).flink.rest_port, log_path=folder / "job.log")
    bridge = HttpBridge(config_path, log_path=folder / "bridge.log")
    try:
        job.start()
        bridge.start()
        running = Stack(folder, config_path, job, bridge)
        yield running
    finally:
        for process in [*getattr(locals().get("running"), "extra", []), bridge, job]:
            process.stop()


def features(count: int, seed: int) -> np.ndarray:
    return np.round(np.random.default_rng(seed).normal(size=(count, FEATURES)), 4).astype(np.float32)


def test_predict_v1_and_v2_match_onnxruntime(stack: Stack) -> None:
    rows = features(3, seed=1)
    expected = stack.expected(rows)
    instances = [{"features": row.tolist()} for row in rows]
    for route in ("/predict", "/v1/models/model:predict"):
        status, body = http_call(f"{stack.url}{route}", {"instances": instances})
        assert status == 200, body
        np.testing.assert_allclose(np.array(body["predictions"]), expected, atol=1e-5)

    request = {"id": "r-1", "inputs": [{"name": "features", "shape": [3, FEATURES], "datatype": "FP32", "data": rows.ravel().tolist()}]}
    status, body = http_call(f"{stack.url}/v2/models/model/infer", request)
    assert status == 200, body
    assert body["model_name"] == "model" and body["id"] == "r-1"
    (output,) = body["outputs"]
    assert output["name"] == "probabilities" and output["datatype"] == "FP32" and output["shape"] == [3, 10]
    np.testing.assert_allclose(np.array(output["data"]).reshape(3, 10), expected, atol=1e-5)


def test_input_queue_predict_goes_through_the_bridge(stack: Stack) -> None:
    """BigDL's synchronous client call: InputQueue(sync=True, frontend_url=...).predict(json text)."""
    rows = features(2, seed=4)
    sync = InputQueue(sync=True, frontend_url=stack.url)
    predictions = sync.predict(json.dumps({"instances": [{"features": row.tolist()} for row in rows]}))
    np.testing.assert_allclose(np.array(predictions), stack.expected(rows), atol=1e-5)
    with pytest.raises(PredictError, match="400: instance 0: .*shape") as refused:
        sync.predict({"instances": [{"features": [1.0, 2.0]}]})
    assert refused.value.status == 400
    with pytest.raises(RuntimeError, match="sync=True"):
        sync.enqueue("u", features=rows[0])


def test_model_and_health_routes(stack: Stack) -> None:
    assert http_call(f"{stack.url}/v1/models") == (200, {"models": ["model"]})
    assert http_call(f"{stack.url}/v1/models/model") == (200, {"name": "model", "ready": True})
    assert http_call(f"{stack.url}/v2/health/live") == (200, {"live": True})
    assert http_call(f"{stack.url}/v2/health/ready") == (200, {"ready": True})
    assert http_call(f"{stack.url}/v2/models/model/ready") == (200, {"name": "model", "ready": True})
    status, metadata = http_call(f"{stack.url}/v2/models/model")
    assert status == 200 and metadata["platform"] == "onnxruntime_onnx"
    assert metadata["inputs"] == [{"name": "features", "datatype": "FP32", "shape": [-1, FEATURES]}]
    assert metadata["outputs"] == [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 10]}]
    status, openapi = http_call(f"{stack.url}/openapi.json")
    assert status == 200 and "/v2/models/{model_name}/infer" in openapi["paths"]


INFER = "/v2/models/model/infer"
OUT_OF_FLOAT32 = "input 'features': values outside the range of float32"


def v2_body(shape: list, data: list, datatype: str = "FP32") -> dict:
    return {"inputs": [{"name": "features", "shape": shape, "datatype": datatype, "data": data}]}


@pytest.mark.parametrize(
    ("route", "body", "status", "message"),
    [
        ("/predict", "{not json", 400, "body is not valid JSON"),
        ("/predict", {"instance": []}, 400, "instances: Field required"),
        ("/predict", {"instances": []}, 400, "instances: List should have at least 1 item"),
        ("/predict", {"instances": [{"features": [1.0, 2.0]}]}, 400, "instance 0: invalid input: input 'features': shape (2,)"),
        ("/predict", {"instances": [{"features": ["a"] * FEATURES}]}, 400, "expects float32 numbers, got strings"),
        ("/predict", {"instances": [{"features": [[1.0], [1.0, 2.0]]}]}, 400, "nested lists must be rectangular"),
        ("/predict", {"instances": [{"pixels": [1.0] * FEATURES}]}, 400, "unknown input 'pixels'"),
        ("/v1/models/other:predict", {"instances": [{"features": [1.0] * FEATURES}]}, 404, "model 'other' not found"),
        ("/v2/models/other", None, 404, "model 'other' not found"),
        ("/no/such/route", None, 404, "no route /no/such/route"),
        ("/v2/models/model/infer", {"inputs": [{"name": "features", "shape": [2, FEATURES], "datatype": "FP32", "data": [1.0]}]},
         400, "1 values do not fill shape [2, 16]"),
        ("/v2/models/model/infer", {"inputs": [{"name": "features", "shape": [1, FEATURES], "datatype": "FP99", "data": [1.0] * FEATURES}]},
         400, "unknown datatype 'FP99'"),
        # Strict JSON numbers: NaN and infinities are not JSON; values must fit the input's dtype.
        ("/predict", '{"instances": [{"features": [NaN]}]}', 400, "body is not valid JSON: NaN is not a JSON value"),
        ("/predict", '{"instances": [{"features": [-Infinity]}]}', 400, "body is not valid JSON: -Infinity is not"),
        (INFER, '{"inputs": [{"name": "features", "shape": [1], "datatype": "FP32", "data": [Infinity]}]}',
         400, "body is not valid JSON: Infinity is not a JSON value"),
        ("/predict", {"instances": [{"features": [1e39] * FEATURES}]}, 400, f"instance 0: {OUT_OF_FLOAT32}"),
        ("/predict", '{"instances": [{"features": [1e999]}]}', 400, f"instance 0: {OUT_OF_FLOAT32}"),
        ("/predict", {"instances": [{"features": [True] * FEATURES}]}, 400, "instance 0: input 'features': expects float32, got booleans"),
        (INFER, v2_body([1, FEATURES], [1e39] * FEATURES), 400, OUT_OF_FLOAT32),
        # v2 shapes checked before any array is built; datatypes of another kind refused.
        (INFER, v2_body([1] * 66, [1.0]), 400, "inputs.0.shape: List should have at most 16 items"),
        (INFER, v2_body(["1", "16"], [1.0] * FEATURES), 400, "inputs.0.shape.0: Input should be a valid integer"),
        (INFER, v2_body([0, 2], []), 400, "the batch dimension is 0"),
        (INFER, v2_body([1025, FEATURES], [0.5] * 1025 * FEATURES), 413, "batch of 1025, over the limit of 1024"),
        (INFER, v2_body([2, FEATURES], [[0.5] * FEATURES]), 400, "nested data do not have shape [2, 16]"),
        (INFER, v2_body([1, FEATURES], [1] * FEATURES, "INT32"), 400, "input 'features': expects FP32, got INT32"),
        (INFER, v2_body([1, FEATURES], [True] * FEATURES, "BOOL"), 400, "input 'features': expects FP32, got BOOL"),
        (INFER, v2_body([1, FEATURES], [1] * FEATURES, "UINT64"), 400, "input 'features': expects FP32, got UINT64"),
    ],
)
def test_errors_are_json_with_the_right_status(stack: Stack, route: str, body: object, status: int, message: str) -> None:
    got_status, got = http_call(f"{stack.url}{route}", body)
    assert got_status == status, got
    assert list(got) == ["error"] and message in got["error"], got


def test_v2_casts_within_a_kind_and_takes_nested_data(stack: Stack) -> None:
    rows = features(2, seed=5)
    status, body = http_call(f"{stack.url}{INFER}", v2_body([2, FEATURES], rows.astype(np.float64).tolist(), "FP64"))
    assert status == 200, body
    np.testing.assert_allclose(np.array(body["outputs"][0]["data"]).reshape(2, 10), stack.expected(rows), atol=1e-5)


def test_unparsable_requests_get_a_counted_json_400(stack: Stack) -> None:
    """Requests uvicorn's HTTP parser (httptools: llhttp's reasons) refuses before the app sees them."""
    before = metric(stack.url, "cluster_serving.http.responses.400")["count"]
    host, port = stack.url.removeprefix("http://").split(":")
    for headers, reason in [
        (b"Content-Length: abc\r\n", "Invalid character in Content-Length"),
        (b"Content-Length: 2\r\nContent-Length: 3\r\n", "Duplicate Content-Length"),
    ]:
        with socket.create_connection((host, int(port)), timeout=10) as connection:
            connection.sendall(b"POST /predict HTTP/1.1\r\nHost: bridge\r\n" + headers + b"\r\n{}")
            answer = b""
            while chunk := connection.recv(65536):
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head.lower(), answer
        assert json.loads(body) == {"error": f"malformed HTTP request: {reason}"}
    assert metric(stack.url, "cluster_serving.http.responses.400")["count"] == before + 2


def test_size_rate_and_token_guards(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CS_TEST_TOKEN", TOKEN)
    url = stack.another_bridge(
        token_env="CS_TEST_TOKEN", max_body_bytes=4096, max_instances=2, rate_limit_per_s=0.5, rate_limit_burst=2
    )
    auth = {"Authorization": f"Bearer {TOKEN}"}
    one = {"instances": [{"features": [0.5] * FEATURES}]}
    assert http_call(f"{url}/predict", one)[0] == 401
    assert http_call(f"{url}/predict", one, headers={"Authorization": "Bearer wrong"})[0] == 401
    assert http_call(f"{url}/v2/health/live") == (200, {"live": True})  # probes need no token
    status, body = http_call(f"{url}/predict", {"instances": [{"features": [0.5] * 1000}]}, headers=auth)
    assert status == 413 and "over the limit of 4096 bytes" in body["error"]
    status, body = http_call(f"{url}/predict", {"instances": [{"features": [0.5] * FEATURES}] * 3}, headers=auth)
    assert status == 413 and "3 instances, over the limit of 2" in body["error"]
    # The body-size check comes before the rate limit, the instance count after: one token spent,
    # one left of the burst of 2; the next request within 2 s is refused.
    assert http_call(f"{url}/predict", one, headers=auth)[0] == 200
    status, body = http_call(f"{url}/predict", one, headers=auth)
    assert status == 429 and "rate limit" in body["error"]
    time.sleep(2.1)
    status, body = http_call(f"{url}/predict", one, headers=auth)
    assert status == 200, body


def test_not_ready_without_a_running_job(stack: Stack) -> None:
    url = stack.another_bridge(flink_rest_url=f"http://127.0.0.1:{free_port()}")
    status, body = http_call(f"{url}/v2/health/ready")
    assert status == 503 and "Flink REST API not reachable" in body["error"]
    assert http_call(f"{url}/v2/models/model/ready")[0] == 503
    assert http_call(f"{url}/v1/models/model") == (200, {"name": "model", "ready": False})
    status, body = http_call(f"{url}/predict", {"instances": [{"features": [0.5] * FEATURES}]})
    assert status == 503 and body["error"].startswith("not ready")


def test_a_lost_broker_is_a_503_and_a_few_log_lines_until_it_is_back(tmp_path: Path, sample_model: Path) -> None:
    """librdkafka retries a lost broker by itself and calls every failed attempt an error: the
    bridge's log must not fill with them (its two clients wrote 24 lines a second)."""
    port = free_port()
    own_broker = LocalBroker(tmp_path / "kafka", port=port, log_path=tmp_path / "broker.log").start()
    config_path = write_run_config(tmp_path, sample_model, own_broker.bootstrap_servers)
    log_path = tmp_path / "bridge.log"
    with HttpBridge(config_path, log_path=log_path) as bridge:
        no_job = http_call(f"{bridge.url}/v2/health/ready")
        assert no_job[0] == 503 and "Flink REST API not reachable" in no_job[1]["error"], no_job
        logged = len(log_path.read_text().splitlines())
        own_broker.stop()
        time.sleep(12)
        http_call(f"{bridge.url}/v2/health/ready")  # a request takes the last check's answer and starts a new one
        time.sleep(1)
        status, body = http_call(f"{bridge.url}/predict", {"instances": [{"features": [0.5] * FEATURES}]})
        assert status == 503 and "no Kafka broker reachable" in body["error"], body
        lines = log_path.read_text().splitlines()[logged:]
        assert 1 <= len(lines) <= 6 and all("brokers are down" in line for line in lines), lines
        with LocalBroker(tmp_path / "kafka", port=port, log_path=tmp_path / "broker-again.log"):
            http_call(f"{bridge.url}/v2/health/ready")
            time.sleep(1)
            assert http_call(f"{bridge.url}/v2/health/ready") == no_job


def test_timeout_gives_504_and_the_late_result_is_dropped(stack: Stack) -> None:
    url = stack.another_bridge(request_timeout_s=0.001)
    status, body = http_call(f"{url}/predict", {"instances": [{"features": [0.5] * FEATURES}]})
    assert status == 504 and "no result within 0.001 s" in body["error"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and metric(url, "cluster_serving.http.late_results")["count"] < 1:
        time.sleep(0.2)
    assert metric(url, "cluster_serving.http.late_results")["count"] == 1
    assert metric(url, "cluster_serving.http.responses.504")["count"] == 1


def metric(url: str, name: str) -> dict:
    status, metrics = http_call(f"{url}/metrics")
    assert status == 200
    return next((entry for entry in metrics if entry["name"] == name), {"name": name, "count": 0})


def test_64_concurrent_clients_get_their_own_answers_and_metrics_count_them(stack: Stack) -> None:
    clients, per_client = 64, 50
    before = metric(stack.url, "cluster_serving.http.request")["count"]
    rows = features(clients * per_client, seed=7)
    expected = stack.expected(rows)

    def client(index: int) -> list[tuple[int, object]]:
        answers = []
        for j in range(per_client):
            row = index * per_client + j
            answers.append((row, http_call(f"{stack.url}/predict", {"instances": [{"features": rows[row].tolist()}]})))
        return answers

    started = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        answers = [answer for batch in pool.map(client, range(clients)) for answer in batch]
    elapsed = time.monotonic() - started
    assert len(answers) == clients * per_client
    for row, (status, body) in answers:
        assert status == 200, body
        np.testing.assert_allclose(body["predictions"][0], expected[row], atol=1e-5)

    request_timer = metric(stack.url, "cluster_serving.http.request")
    assert request_timer["count"] - before == clients * per_client
    assert metric(stack.url, "cluster_serving.job.inference")["count"] >= clients * per_client
    print(
        f"\n{clients} clients x {per_client} requests: {len(answers) / elapsed:.0f} req/s, "
        f"bridge request p50 {request_timer['median']:.1f} ms, p99 {request_timer['_99thPercentile']:.1f} ms"
    )
    status, text = http_call(f"{stack.url}/metrics/prometheus")
    assert status == 200 and "cluster_serving_http_request_seconds_count" in text


def test_flink_ui_shows_the_operator_metrics(stack: Stack) -> None:
    """The job's metrics as the Flink web UI reads them (REST), after the module's requests."""
    http_call(f"{stack.url}/predict", {"instances": [{"features": [0.5] * FEATURES}]})
    wanted = {"numRecordsIn", "numRecordsOut", "batchSize", "inferenceTimeUs", "decodeErrors", "inferenceErrors"}
    found: set[str] = set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not wanted <= found:
        job = stack.job.rest(f"/jobs/{stack.job.job_id}")
        for vertex in job["vertices"]:
            names = [item["id"] for item in stack.job.rest(f"/jobs/{stack.job.job_id}/vertices/{vertex['id']}/metrics")]
            found |= {want for want in wanted for name in names if name.endswith(want)}
        time.sleep(1)
    assert wanted <= found, f"missing in the Flink REST API: {wanted - found}"


def test_openapi_fuzzing_finds_no_undocumented_server_errors(stack: Stack, tmp_path: Path) -> None:
    """schemathesis drives every route from /openapi.json; 5xx other than 503/504 fail it, and so
    do statuses or bodies the document does not declare."""
    result = subprocess.run(
        [
            Path(sys.executable).with_name("schemathesis"), "run", f"{stack.url}/openapi.json",
            "--checks", "not_a_server_error,status_code_conformance,response_schema_conformance,content_type_conformance",
            "--max-examples", "25", "--seed", "7", "--request-timeout", "40", "--phases", "examples,coverage,fuzzing",
        ],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,  # it writes a .schemathesis folder
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "passed" in result.stdout


def test_bridge_connections_send_small_writes_at_once() -> None:
    """Nagle's algorithm off on accepted connections: with it on, every response's body waited
    for the client's delayed ACK (measured: 42 ms per /v2/health/live, 1.4 ms without)."""
    listener = listen("127.0.0.1", free_port())

    async def nodelay_of_accepted_socket() -> int:
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        async with await asyncio.start_server(on_connect, sock=listener):
            _, writer = await asyncio.open_connection(*listener.getsockname())
            try:
                return await asyncio.wait_for(accepted, 10)
            finally:
                writer.close()

    assert asyncio.run(nodelay_of_accepted_socket()) != 0


def binary_infer(url: str, request: dict, binary: bytes) -> tuple[int, dict, bytes, Message]:
    """POST a v2 request with the binary tensor data extension: (status, JSON part, binary part, headers)."""
    header = json.dumps(request).encode()
    call = urllib.request.Request(
        f"{url}/v2/models/model/infer", data=header + binary, method="POST",
        headers={"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"},
    )
    try:
        with urllib.request.urlopen(call, timeout=60) as response:
            status, payload, headers = response.status, response.read(), response.headers
    except urllib.error.HTTPError as error:
        status, payload, headers = error.code, error.read(), error.headers
    length = int(headers.get("Inference-Header-Content-Length", len(payload)))
    return status, json.loads(payload[:length]), payload[length:], headers


def test_v2_binary_tensor_data_in_and_out(stack: Stack) -> None:
    """Triton's and KServe's binary extension: raw little-endian values after the JSON part."""
    rows = features(4, seed=11)
    expected = stack.expected(rows)
    tensor = {"name": "features", "shape": [4, FEATURES], "datatype": "FP32", "parameters": {"binary_data_size": rows.nbytes}}
    status, body, binary, headers = binary_infer(stack.url, {"inputs": [tensor], "parameters": {"binary_data_output": True}}, rows.tobytes())
    assert status == 200, body
    (output,) = body["outputs"]
    assert output["shape"] == [4, 10] and output["parameters"] == {"binary_data_size": 4 * 10 * 4} and "data" not in output
    assert headers["Content-Type"] == "application/octet-stream"
    np.testing.assert_allclose(np.frombuffer(binary, "<f4").reshape(4, 10), expected, atol=1e-5)

    status, body, binary, _ = binary_infer(stack.url, {"inputs": [tensor]}, rows.tobytes())
    assert status == 200 and binary == b"", body
    np.testing.assert_allclose(np.array(body["outputs"][0]["data"]).reshape(4, 10), expected, atol=1e-5)
    assert http_call(f"{stack.url}/v2")[1]["extensions"] == ["binary_tensor_data"]


@pytest.mark.parametrize(
    ("tensor", "binary", "message"),
    [
        ({"binary_data_size": 10}, b"\0" * 8, "binary_data_size 10 is not within the 8 bytes left"),
        ({"binary_data_size": 8}, b"\0" * 12, "4 bytes of binary data belong to no input"),
        ({"binary_data_size": 6}, b"\0" * 6, "6 bytes are not a whole number of FP32 values"),
        ({"binary_data_size": 8}, b"\0" * 8, "2 values do not fill shape"),
    ],
)
def test_v2_binary_tensor_data_that_does_not_add_up_is_refused(stack: Stack, tensor: dict, binary: bytes, message: str) -> None:
    request = {"inputs": [{"name": "features", "shape": [1, FEATURES], "datatype": "FP32", "parameters": tensor}]}
    status, body, _, _ = binary_infer(stack.url, request, binary)
    assert status == 400 and message in body["error"], body


def test_https_with_a_token_serves_predictions_and_status_sees_it(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CS_TLS_TOKEN", TOKEN)
    certificates = local_certificates(stack.folder / "tls")
    url = stack.another_bridge(tls_cert=str(certificates.certificate), tls_key=str(certificates.key), token_env="CS_TLS_TOKEN")
    assert url.startswith("https://127.0.0.1:")
    trusting = ssl.create_default_context(cafile=str(certificates.ca))
    rows = features(2, seed=9)
    body = {"instances": [{"features": row.tolist()} for row in rows]}
    status, answer = http_call(f"{url}/v1/models/model:predict", body, {"Authorization": f"Bearer {TOKEN}"}, trusting)
    assert status == 200, answer
    np.testing.assert_allclose(np.array(answer["predictions"]), stack.expected(rows), atol=1e-5)
    assert http_call(f"{url}/v1/models/model:predict", body, context=trusting)[0] == 401
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        http_call(f"{url}/v2/health/live")  # a client that does not trust the CA
    with pytest.raises((ConnectionError, urllib.error.URLError)):
        http_call(url.replace("https://", "http://") + "/v2/health/live")
    config = load_config(stack.folder / f"bridge-{len(stack.extra) - 1}.yaml")
    assert bridge_state(config) == f"ready on {url}"


def test_a_tls_key_that_does_not_fit_is_one_error_line(stack: Stack) -> None:
    certificates = local_certificates(stack.folder / "tls")
    raw = yaml.safe_load(stack.config_path.read_text())
    raw["http"] = {**raw.get("http", {}), "port": free_port(), "tls_cert": str(certificates.ca), "tls_key": str(certificates.key)}
    path = stack.folder / "bad-tls.yaml"
    path.write_text(yaml.safe_dump(raw))
    done = subprocess.run([sys.executable, "-m", "cluster_serving.http.server", "--config", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line == (
        f"error: http.tls_cert/http.tls_key: {certificates.ca} and {certificates.key} do not load as a PEM certificate"
        " and its key: key values mismatch"
    )
