"""The serving job submitted with `flink run -py` to a standalone Flink cluster (the pip-installed
PyFlink's start-cluster.sh), as opposed to the embedded MiniCluster of the other end-to-end tests."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from collections.abc import Iterator

import pytest

from tests.flink_cluster import StandaloneCluster
from cluster_serving.ops.children import HttpBridge
from cluster_serving.ops.processes import free_port
from cluster_serving.ops.sample_model import FEATURES
from tests.conftest import assert_served, http_call

log = logging.getLogger(__name__)
COUNT = 200


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[StandaloneCluster]:
    """A running cluster; stopped at teardown, and checked to have left no process behind."""
    standalone = StandaloneCluster(free_port(), tmp_path / "flink")
    started = time.monotonic()
    with standalone:
        log.info("cluster start: %.1f s", time.monotonic() - started)
        yield standalone
    assert standalone.processes() == [], "Flink processes left after stop()"


def test_flink_run_py_serves_requests(cluster: StandaloneCluster, write_config) -> None:
    path, config = write_config(flink={"rest_port": cluster.rest_port})
    submitted = time.monotonic()
    job_id = cluster.submit(path)
    cluster.rest.wait_until_running(job_id, timeout_s=120)
    log.info("submit to running: %.1f s", time.monotonic() - submitted)
    assert cluster.rest.get("/overview")["jobs-running"] == 1

    assert_served(config, COUNT, seed=7, timeout=90)
    # The bridge finds the job on the cluster's REST API (http.flink_rest_url defaults to it here).
    with HttpBridge(path, log_path=path.parent / "bridge.log") as bridge:
        assert http_call(f"{bridge.url}/v2/health/ready") == (200, {"ready": True})
        status, body = http_call(f"{bridge.url}/predict", {"instances": [{"features": [0.1] * FEATURES}]})
        assert status == 200 and len(body["predictions"][0]) == 10, body

    cluster.rest.cancel(job_id)
    assert cluster.rest.job(job_id)["state"] == "CANCELED"
