"""The serving job on a standalone Flink cluster, as a user runs one: `cluster-serving cluster up`
(the pip-installed PyFlink's start-cluster.sh), `submit` (`flink run -py`), `status`, `down`, as
opposed to the embedded MiniCluster of the other end-to-end tests."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from cluster_serving.ops.children import HttpBridge
from cluster_serving.ops.cluster import StandaloneCluster
from cluster_serving.ops.processes import free_port
from cluster_serving.ops.sample_model import FEATURES
from tests.conftest import assert_served, http_call

log = logging.getLogger(__name__)
COUNT = 200


def cluster_command(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cluster_serving.ops.cli", "cluster", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_cluster_up_submit_status_down_serves_requests(tmp_path: Path, write_config) -> None:
    folder, rest_port = tmp_path / "flink", free_port()
    path, config = write_config(flink={"rest_port": rest_port})
    up = cluster_command("up", "--dir", str(folder), "--rest-port", str(rest_port), "--taskmanagers", "2", "--task-slots", "1")
    cluster = StandaloneCluster.of_folder(folder)
    try:
        assert up.returncode == 0, up.stderr
        assert f"2 TaskManager(s) x 1 slots; web UI http://127.0.0.1:{rest_port}" in up.stdout
        again = cluster_command("up", "--dir", str(folder), "--rest-port", str(free_port()))
        assert again.returncode == 2 and again.stderr.startswith(f"error: a Flink cluster already runs from {folder}")

        submitted = cluster_command("submit", "--dir", str(folder), "-c", str(path))
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        job_id = submitted.stdout.split()[1]
        assert cluster.rest.job(job_id)["state"] == "RUNNING"

        status = cluster_command("status", "--dir", str(folder))
        assert status.returncode == 0
        assert "2 TaskManager(s), 1 of 2 slots free" in status.stdout and f"job {job_id} cluster-serving: RUNNING" in status.stdout

        assert_served(config, COUNT, seed=7, timeout=90)
        # The bridge finds the job on the cluster's REST API (http.flink_rest_url defaults to it here).
        with HttpBridge(path, log_path=path.parent / "bridge.log") as bridge:
            assert http_call(f"{bridge.url}/v2/health/ready") == (200, {"ready": True})
            status_code, body = http_call(f"{bridge.url}/predict", {"instances": [{"features": [0.1] * FEATURES}]})
            assert status_code == 200 and len(body["predictions"][0]) == 10, body
    finally:
        down = cluster_command("down", "--dir", str(folder))
    assert down.returncode == 0 and "stopped" in down.stdout
    assert cluster.processes() == [], "Flink processes left after `cluster down`"
    gone = cluster_command("status", "--dir", str(folder))
    assert gone.returncode == 3 and "not answering" in gone.stdout
