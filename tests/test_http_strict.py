"""The HTTP bridge's strict reading of requests, without Kafka or Flink: JSON numbers, v2 shapes and
datatypes checked before any array is built, and every response counted once, 500s included
(a bridge in this process, its Kafka never connected)."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import uvicorn

from cluster_serving.config import load_config
from cluster_serving.http.asgi.binary_tensors import values_from_bytes
from cluster_serving.wire.tensors import raw_bytes
from cluster_serving.http.dataplane import Bridge
from cluster_serving.http.errors import BridgeError
from cluster_serving.http.json_tensors import strict_json, v2_instances
from cluster_serving.http.server import listen, server_config
from cluster_serving.ops.processes import free_port, write_run_config
from cluster_serving.ops.sample_model import FEATURES
from cluster_serving.runtime.signature import ModelSignature, read_signature
from cluster_serving.wire.tensors import TensorError, TensorSpec, dense_array
from tests.conftest import http_call

TOKEN = "strict-token-9a2e"
ONE = {"instances": [{"features": [0.5] * FEATURES}]}


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_strict_json_refuses_what_json_has_not(constant: str) -> None:
    with pytest.raises(json.JSONDecodeError, match=f"{constant} is not a JSON value"):
        strict_json(f'{{"instances": [{{"features": [1.0, {constant}]}}]}}'.encode())
    assert strict_json(b'{"a": [1.5, -2, 1e999]}') == {"a": [1.5, -2, float("inf")]}


@pytest.mark.parametrize(
    ("value", "dtype", "message"),
    [
        ([1.0, 1e39], "float32", "values outside the range of float32"),
        ([1e999], "float32", "values outside the range of float32"),
        ([1e999], None, "values outside the range of float64"),
        ([70000], "float16", "values outside the range of float16"),
        ([1, 300], "uint8", "values outside the range of uint8"),
        ([-1], "uint8", "values outside the range of uint8"),
        ([1e999], "int64", "values outside the range of int64"),
        ([1.5], "int32", "expects int32, got fractional values"),
        ([True, False], "float32", "expects float32, got booleans"),
        ([1, 0], "bool", "expects bool, got numbers"),
        (["1.5"], "float32", "expects float32 numbers, got strings"),
    ],
)
def test_dense_values_out_of_the_dtype_are_refused(value: list, dtype: str | None, message: str) -> None:
    with pytest.raises(TensorError, match=f"input 'x': {message}"):
        dense_array("x", value, None if dtype is None else np.dtype(dtype), from_json=True)


def test_dense_values_within_the_dtype_are_typed() -> None:
    assert dense_array("x", [0, 255], np.dtype("uint8")).tolist() == [0, 255]
    assert dense_array("x", [3.4e38, -1], np.dtype("float32")).dtype == np.float32


@pytest.fixture(scope="module")
def signature(sample_model: Path) -> ModelSignature:
    return read_signature(sample_model)


def v2(shape: list[int], data: list, datatype: str = "FP32", name: str = "features") -> dict:
    return {"name": name, "shape": shape, "datatype": datatype, "data": data}


@pytest.mark.parametrize(
    ("inputs", "status", "message"),
    [
        ([v2([0, FEATURES], [])], 400, "the batch dimension is 0"),
        ([v2([2**40, 2**40], [1.0])], 400, "1 values do not fill shape [1099511627776, 1099511627776]"),
        ([v2([2, FEATURES], [[0.5] * FEATURES])], 400, "nested data do not have shape [2, 16]"),
        ([v2([1, FEATURES], [[0.5] * (FEATURES - 1) + [[0.5]]])], 400, "nested data do not have shape [1, 16]"),
        ([v2([5, FEATURES], [0.5] * 5 * FEATURES)], 413, "batch of 5, over the limit of 4"),
        ([v2([1, 300], [0.5] * 300)], 413, "1200 bytes of values per instance, over the limit of 1024"),
        ([v2([1, FEATURES], [1] * FEATURES, "INT32")], 400, "input 'features': expects FP32, got INT32"),
        ([v2([1, FEATURES], [True] * FEATURES, "BOOL")], 400, "input 'features': expects FP32, got BOOL"),
        ([v2([1, FEATURES], [1] * FEATURES, "UINT64")], 400, "input 'features': expects FP32, got UINT64"),
        ([v2([1, FEATURES], [1e39] * FEATURES, "FP64")], 400, "input 'features': values outside the range of float32"),
        ([v2([1, FEATURES], [0.5] * FEATURES)] * 2, 400, "input 'features' given twice"),
    ],
)
def test_v2_requests_are_checked_before_arrays_are_built(
    signature: ModelSignature, inputs: list[dict], status: int, message: str
) -> None:
    with pytest.raises(BridgeError) as refused:
        v2_instances(inputs, signature, max_instances=4, max_instance_bytes=1024)
    assert refused.value.status == status and message in str(refused.value)


KINDS = ModelSignature(tuple(TensorSpec(name, np.dtype(dtype), (None, 2)) for name, dtype in
                             (("f", "float32"), ("i", "int64"), ("u", "uint8"), ("b", "bool"), ("s", "object"))), ())


@pytest.mark.parametrize(
    ("name", "datatype", "data"),
    [("f", "INT64", [1, 2]), ("f", "BYTES", ["1", "2"]), ("i", "FP32", [1.0, 2.0]), ("i", "BOOL", [True, False]),
     ("u", "FP64", [1.0, 2.0]), ("b", "INT8", [1, 0]), ("b", "FP32", [1.0, 0.0]), ("s", "INT32", [1, 2])],
)
def test_v2_casts_across_kinds_are_refused(name: str, datatype: str, data: list) -> None:
    """Whatever the values, a datatype of another kind than the input's is refused, in the
    README's words: the data are not typed as the model's input behind the client's back."""
    with pytest.raises(BridgeError) as refused:
        v2_instances([v2([1, 2], data, datatype, name)], KINDS, max_instances=4, max_instance_bytes=1024)
    assert refused.value.status == 400
    assert str(refused.value) == f"input {name!r}: expects {KINDS.input(name).datatype}, got {datatype}"


def test_v2_casts_within_a_kind_and_takes_nested_data(signature: ModelSignature) -> None:
    rows = [[0.25] * FEATURES, [0.75] * FEATURES]
    for data in (rows, [value for row in rows for value in row]):
        instances = v2_instances([v2([2, FEATURES], data, "FP64")], signature, max_instances=4, max_instance_bytes=1024)
        assert [instance["features"].dtype for instance in instances] == [np.float32, np.float32]
        np.testing.assert_array_equal(np.stack([instance["features"] for instance in instances]), rows)
    uint8 = ModelSignature((TensorSpec("pixels", np.dtype("uint8"), (None, 2)),), ())
    (instance,) = v2_instances([v2([1, 2], [7, 255], "INT64", "pixels")], uint8, max_instances=4, max_instance_bytes=1024)
    assert instance["pixels"].dtype == np.uint8
    with pytest.raises(BridgeError, match="input 'pixels': values outside the range of uint8"):
        v2_instances([v2([1, 2], [7, 300], "INT64", "pixels")], uint8, max_instances=4, max_instance_bytes=1024)


@pytest.fixture
def local_bridge(tmp_path: Path, sample_model: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Bridge]]:
    """A never-started `Bridge` (no Kafka: predict answers 503) with a token, a 1 KiB body limit and
    a burst of one request, served in this process as `run_bridge` serves it."""
    monkeypatch.setenv("CS_STRICT_TOKEN", TOKEN)
    http = {"token_env": "CS_STRICT_TOKEN", "max_body_bytes": 1024, "rate_limit_per_s": 0.01, "rate_limit_burst": 1}
    bridge = Bridge(load_config(write_run_config(tmp_path, sample_model, "127.0.0.1:9", http=http)))
    server = uvicorn.Server(server_config(bridge))
    listener = listen("127.0.0.1", free_port())
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    host, port = listener.getsockname()[:2]
    yield f"http://{host}:{port}", bridge
    server.should_exit = True
    thread.join(10)


def responses(bridge: Bridge) -> dict[int, int]:
    prefix = "cluster_serving.http.responses."
    counts = {entry["name"]: entry["count"] for entry in bridge.metrics.dropwizard()}
    return {int(name[len(prefix):]): count for name, count in counts.items() if name.startswith(prefix)}


def test_every_response_is_counted_once(local_bridge: tuple[str, Bridge], monkeypatch: pytest.MonkeyPatch) -> None:
    url, bridge = local_bridge
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert http_call(f"{url}/predict", ONE)[0] == 401
    assert http_call(f"{url}/predict", {"instances": [{"features": [0.5] * 1000}]}, headers=auth)[0] == 413
    assert http_call(f"{url}/predict", ONE, headers=auth)[0] == 503  # the one token of the burst
    assert http_call(f"{url}/predict", ONE, headers=auth)[0] == 429
    assert http_call(f"{url}/predict", '{"instances": [{"features": [NaN]}]}', headers=auth)[0] == 400

    async def broken() -> str | None:
        raise RuntimeError("readiness check broke")

    monkeypatch.setattr(bridge, "not_ready_reason", broken)
    assert http_call(f"{url}/v2/health/ready") == (500, {"error": "internal error: RuntimeError: readiness check broke"})
    assert responses(bridge) == {401: 1, 413: 1, 503: 1, 429: 1, 400: 1, 500: 1}


def test_predict_failures_are_json_errors_and_counted(
    local_bridge: tuple[str, Bridge], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The predict routes are answered ahead of FastAPI's middleware: an exception in one and a
    chunked body that streams past the limit still get the JSON error, counted once."""
    url, bridge = local_bridge
    auth = {"Authorization": f"Bearer {TOKEN}"}

    async def broken(instances: list) -> list:
        raise RuntimeError("producer broke")

    monkeypatch.setattr(bridge, "infer", broken)
    broke = {"error": "internal error: RuntimeError: producer broke"}
    assert http_call(f"{url}/predict", ONE, headers=auth) == (500, broke)
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    chunks = iter([b'{"instances": [', b"1, " * 600, b"1]}"])  # no Content-Length: sent chunked
    connection.request("POST", "/predict", body=chunks, headers=auth, encode_chunked=True)
    answer = connection.getresponse()
    assert (answer.status, json.loads(answer.read())) == (413, {"error": "request body over the limit of 1024 bytes"})
    connection.close()
    assert responses(bridge) == {500: 1, 413: 1}


def test_binary_tensor_values_round_trip_every_datatype() -> None:
    for array in (np.arange(6, dtype=np.int16), np.array([True, False]), np.array(["a", "", "żółw"], dtype=object),
                  np.linspace(0, 1, 5, dtype=np.float16)):
        datatype = "BYTES" if array.dtype.kind == "O" else TensorSpec("x", array.dtype, ()).datatype
        back = values_from_bytes("x", datatype, raw_bytes(array))
        assert back.tolist() == array.tolist()


@pytest.mark.parametrize(
    ("datatype", "chunk", "message"),
    [
        ("BOOL", b"\x02", "a BOOL value is one byte, 0 or 1"),
        ("BYTES", b"\x05\x00\x00\x00ab", "runs past the data"),
        ("BYTES", b"\x01\x00", "end inside a length prefix"),
        ("BYTES", b"\x01\x00\x00\x00\xff", "must be UTF-8 text"),
        ("INT64", b"\x00" * 12, "not a whole number of INT64 values"),
        ("FP8", b"", "unknown datatype 'FP8'"),
    ],
)
def test_binary_tensor_values_that_do_not_parse_are_refused(datatype: str, chunk: bytes, message: str) -> None:
    with pytest.raises(BridgeError, match=message):
        values_from_bytes("x", datatype, chunk)
