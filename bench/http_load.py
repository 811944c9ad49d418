"""HTTP load for the benchmark: clients on kept-alive connections, each sending one-instance
POST /predict requests to the bridge, timed as they see it."""

from __future__ import annotations

import http.client
import json
import threading
import time
from typing import Any

import numpy as np

from bench.models import BenchModel
from bench.report import latency_ms

# Distinct /predict bodies, encoded before the clients start so their JSON encoding is not timed.
HTTP_BODIES = 16


def predict_bodies(model: BenchModel, samples: np.ndarray) -> list[str]:
    """One-instance /predict bodies as a user sends them: the tensor as nested JSON lists."""
    return [json.dumps({"instances": [{model.input_name: sample.tolist()}]}) for sample in samples[:HTTP_BODIES]]


def http_load(url: str, bodies: list[str], clients: int, requests: int) -> dict[str, Any]:
    """`clients` threads share `requests` one-instance /predict calls; every answer must be a 200."""
    host, port = url.removeprefix("http://").split(":")
    latencies: list[float] = []
    failures: list[str] = []

    def client(index: int) -> None:
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        for i in range(index, requests, clients):
            started = time.perf_counter()
            connection.request("POST", "/predict", bodies[i % len(bodies)], {"Content-Type": "application/json"})
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
    return {"requests": requests, "rate": len(latencies) / elapsed, **latency_ms(latencies), "failures": len(failures)}

