"""Scaled out on the real broker: a job with parallelism 2 reading 4 partitions, and two HTTP
bridges sharing its result topic, each answering only its own requests."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort
import yaml

from cluster_serving.ops.children import HttpBridge
from cluster_serving.ops.processes import free_port
from cluster_serving.ops.sample_model import FEATURES
from bench.scale_out import requests_per_subtask
from tests.conftest import assert_served, http_call

REQUESTS = 2000
HTTP_REQUESTS_PER_BRIDGE = 200


def second_bridge_config(config_path: Path) -> Path:
    """The same job and topics, another HTTP port."""
    raw = yaml.safe_load(config_path.read_text())
    raw["http"] = {**raw.get("http", {}), "port": free_port()}
    path = config_path.with_name("second-bridge.yaml")
    path.write_text(yaml.safe_dump(raw))
    return path


def test_parallelism_two_on_four_partitions_and_two_bridges(write_config, start_job, tmp_path: Path) -> None:
    path, config = write_config(kafka={"partitions": 4}, flink={"parallelism": 2})
    job = start_job(path, config)
    assert_served(config, REQUESTS, seed=11, timeout=180)

    counts = requests_per_subtask(job.rest, job.job_id, 2, REQUESTS)
    assert len(counts) == 2 and all(count > 0 for count in counts), f"requests per subtask: {counts}"

    first = HttpBridge(path, log_path=tmp_path / "bridge-1.log").start()
    second = HttpBridge(second_bridge_config(path), log_path=tmp_path / "bridge-2.log").start()
    try:
        session = ort.InferenceSession(str(config.model.path))
        rows = np.random.default_rng(12).normal(size=(2 * HTTP_REQUESTS_PER_BRIDGE, FEATURES)).astype(np.float32)
        expected = session.run(None, {"features": rows})[0]
        urls = [first.url, second.url] * HTTP_REQUESTS_PER_BRIDGE

        def predict(i: int) -> tuple[int, object]:
            return http_call(f"{urls[i]}/predict", {"instances": [{"features": rows[i].tolist()}]})

        with ThreadPoolExecutor(max_workers=16) as pool:
            answers = list(pool.map(predict, range(len(rows))))
        for i, (status, body) in enumerate(answers):
            assert status == 200, (i, body)
            np.testing.assert_allclose(body["predictions"][0], expected[i], atol=1e-5)
        late = [http_call(f"{bridge.url}/metrics")[1] for bridge in (first, second)]
    finally:
        second.stop()
        first.stop()
    late_counts = [next((m["count"] for m in metrics if m["name"] == "cluster_serving.http.late_results"), 0) for metrics in late]
    print(json.dumps({"requests per inference subtask": counts, "late results per bridge": late_counts}))
    assert late_counts == [0, 0], "a bridge took the other's results for its own late ones"
