"""`cluster-serving demo` once its checks have passed: a fresh local broker, the job and the bridge,
sample predictions through the client library and through HTTP, then serving until Ctrl-C."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import numpy as np

from cluster_serving.client.queues import InputQueue, OutputQueue
from cluster_serving.config import ServingConfig
from cluster_serving.ops.children import EmbeddedJob, HttpBridge
from cluster_serving.ops.operations import start_local_broker
from cluster_serving.ops.sample_model import FEATURES


def run_demo(config: ServingConfig, config_path: Path, folder: Path, requests: int, no_wait: bool) -> int:
    """Broker, job and bridge, sample predictions through the client and the bridge, then serving
    until Ctrl-C (or at once with `no_wait`); everything started is stopped at the end."""
    # The demo starts from nothing each time: a fresh broker folder, so no retained position applies.
    broker = start_local_broker(config, fresh=True)
    job = EmbeddedJob(config_path, config.flink.rest_port, log_path=folder / "job.log", fresh=True)
    bridge = HttpBridge(config_path, log_path=folder / "http.log")
    try:
        print("starting the serving job on an embedded Flink MiniCluster ...")
        job.start()
        print(f"job {job.job_id} running; Flink web UI: {job.web_ui}; job log: {job.log_path}")
        bridge.start()
        print(f"HTTP bridge: {bridge.url} (POST /predict, GET /metrics, /v1 and /v2 routes); log: {bridge.log_path}")
        show_sample_predictions(config, requests)
        show_http_prediction(bridge.url)
        if no_wait:
            return 0
        print(f"serving; press Ctrl-C to stop (or: cluster-serving stop -c {config_path})")
        while job.running and bridge.running:
            time.sleep(1)
        stopped = job if not job.running else bridge
        print(f"{stopped.module} stopped on its own; its log:\n" + stopped.log_tail())
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        print("stopping ...")
        bridge.stop()
        job.stop()
        if broker:
            broker.stop()


def show_sample_predictions(config: ServingConfig, count: int) -> None:
    """Enqueues `count` random feature vectors through the client library and prints the answers."""
    kafka = config.kafka
    rng = np.random.default_rng()
    with InputQueue(kafka.bootstrap_servers, kafka.input_topic) as inputs, OutputQueue(
        kafka.bootstrap_servers, kafka.result_topic, group_id=f"demo-{time.time_ns()}"
    ) as outputs:
        uris = [f"demo-{i}" for i in range(count)]
        for uri in uris:
            inputs.enqueue(uri, features=rng.normal(size=FEATURES).astype(np.float32))
        inputs.flush()
        print(f"enqueued {count} requests to {kafka.input_topic}")
        for uri in uris:
            result = outputs.query(uri, timeout=30)
            if result is None:
                print(f"{uri}: no result within 30 s")
            elif "error" in result:
                print(f"{uri}: error: {result['error']}")
            else:
                probabilities = next(iter(result.values()))
                top = int(np.argmax(probabilities))
                print(f"{uri}: class {top} (p={probabilities[top]:.3f})")


def show_http_prediction(url: str) -> None:
    """One request through the HTTP bridge, and the curl line that does the same."""
    features = np.round(np.random.default_rng().normal(size=FEATURES), 3).tolist()
    body = json.dumps({"instances": [{"features": features}]})
    request = urllib.request.Request(f"{url}/predict", data=body.encode(), method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        probabilities = json.load(response)["predictions"][0]
    top = int(np.argmax(probabilities))
    print(f"POST {url}/predict: class {top} (p={probabilities[top]:.3f})")
    print(f"try: curl -d '{body}' {url}/predict")
