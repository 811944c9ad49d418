"""HTTP load for the benchmark: clients on kept-alive connections, each sending one-instance
requests to the bridge (POST /predict as JSON, or v2 /infer with binary tensor data), timed as
they see it."""

from __future__ import annotations

import base64
import http.client
import json
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.models import BenchModel
from bench.report import latency_ms
from cluster_serving.wire.codec import EncodedImage

# Distinct request bodies, encoded before the clients start so their encoding is not timed.
HTTP_BODIES = 16
JSON_HEADERS = {"Content-Type": "application/json"}


@dataclass(frozen=True)
class HttpRequest:
    path: str
    body: bytes
    headers: dict[str, str]


def http_protocol(model: BenchModel) -> str:
    return "v2 /infer, binary tensor data" if model.http_binary else "/predict, JSON"


def predict_requests(model: BenchModel, samples: np.ndarray) -> list[HttpRequest]:
    """One-instance requests as a user sends them: /predict with the tensor as nested JSON lists,
    or v2 /infer with the tensor's bytes after a JSON header (the binary tensor data extension)."""
    return [_binary(model, sample) if model.http_binary else _json(model, sample) for sample in samples[:HTTP_BODIES]]


def _json(model: BenchModel, sample: np.ndarray | EncodedImage) -> HttpRequest:
    value = {"b64": base64.b64encode(sample.data).decode()} if isinstance(sample, EncodedImage) else sample.tolist()
    return HttpRequest("/predict", json.dumps({"instances": [{model.input_name: value}]}).encode(), JSON_HEADERS)


def _binary(model: BenchModel, sample: np.ndarray) -> HttpRequest:
    tensor = {"name": model.input_name, "shape": [1, *sample.shape], "datatype": "FP32",
              "parameters": {"binary_data_size": sample.nbytes}}
    header = json.dumps({"inputs": [tensor]}).encode()
    headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))}
    return HttpRequest("/v2/models/model/infer", header + sample.astype("<f4").tobytes(), headers)


def http_load(url: str, bodies: list[HttpRequest], clients: int, seconds: float) -> dict[str, Any]:
    """`clients` threads each sending one-instance calls, one at a time, for `seconds`; every
    answer must be a 200."""
    host, port = url.removeprefix("http://").split(":")
    latencies: list[float] = []
    failures: list[str] = []
    deadline = time.perf_counter() + seconds

    def client(index: int) -> None:
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        i = index
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            call = bodies[i % len(bodies)]
            i += clients
            connection.request("POST", call.path, call.body, call.headers)
            response = connection.getresponse()
            answer = response.read()
            latencies.append((time.perf_counter() - started) * 1000)
            if response.status != 200:
                failures.append(f"{response.status} {answer[:200]!r}")
        connection.close()

    threads = [threading.Thread(target=client, args=(index,)) for index in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    return {"requests": len(latencies), "rate": len(latencies) / elapsed, **latency_ms(latencies), "failures": len(failures)}

