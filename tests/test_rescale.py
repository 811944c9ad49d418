"""Rescaling a running deployment as an operator does it: `cluster-serving start`, then
`flink.parallelism` changed in the config file and `cluster-serving restart` (1 -> 2 -> 4 -> 1),
under exactly_once, while clients keep sending. Each restart stops the job with its final
savepoint and starts it again from there: the savepoint carries the Kafka positions, the
micro-batcher's waiting requests and the routing table to the new subtasks. Every request is
answered once, and a read_committed reader sees no result twice. A config with a mistake is
refused before anything stops."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

from cluster_serving.config import JOB_NAME
from cluster_serving.net.flink_rest import FlinkRest
from cluster_serving.ops.instances import REGISTRY_ENV
from cluster_serving.ops.sample_model import FEATURES
from tests.paths import PROJECT_ROOT
from tests.test_cli_start import cli
from tests.test_recovery import check_all_answered_once, count_results, send

REQUESTS = 20_000
RATE = 200  # requests a second: the stream lasts through every restart below
PARALLELISMS = (1, 2, 4, 1)
SERVE_S = 8  # each run serves this long once it is running, before the next restart


def with_parallelism(path: Path, parallelism: int) -> None:
    """The operator's config change: flink.parallelism in the config file."""
    raw = yaml.safe_load(path.read_text())
    raw["flink"]["parallelism"] = parallelism
    path.write_text(yaml.safe_dump(raw))


def running_job(flink: FlinkRest, timeout: float = 120) -> dict:
    """The job once it and all its tasks run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = flink.find_job(JOB_NAME)
        if isinstance(job, dict) and job["state"] == "RUNNING":
            flink.wait_until_running(job["jid"], deadline - time.monotonic())
            return flink.job(job["jid"])
        time.sleep(0.5)
    raise AssertionError(f"no job running after {timeout} s: {job}")


def subtasks(job: dict) -> list[int]:
    return sorted({vertex["parallelism"] for vertex in job["vertices"]})


def test_rescale_1_2_4_1_with_restart_under_exactly_once_loses_and_repeats_nothing(write_config, tmp_path: Path) -> None:
    path, config = write_config(kafka={"delivery": "exactly_once", "partitions": 4}, batching={"batch_size": 32, "max_delay_ms": 20})
    with_parallelism(path, PARALLELISMS[0])
    env = {**os.environ, REGISTRY_ENV: str(tmp_path / "registry")}
    flink = FlinkRest(f"http://127.0.0.1:{config.flink.rest_port}")
    log = tmp_path / "start.log"
    with open(log, "wb") as output:
        start = subprocess.Popen([sys.executable, "-m", "cluster_serving.ops.cli", "start", "-c", str(path), "--no-http"],
                                 cwd=PROJECT_ROOT, env=env, stdout=output, stderr=subprocess.STDOUT)
    try:
        job = running_job(flink)
        features = np.random.default_rng(12).normal(size=(REQUESTS, FEATURES)).astype(np.float32)
        producer = send(config, features, rate=RATE)
        runs = [{"parallelism": PARALLELISMS[0], "subtasks": subtasks(job)}]
        time.sleep(SERVE_S)
        raw = path.read_text()
        path.write_text(raw.replace("parallelism: 1", "parallelism: 0"))
        refused = cli(env, "restart", "-c", str(path))
        assert refused.returncode == 2 and refused.stderr.startswith("error: flink.parallelism: "), refused.stderr
        assert refused.stderr.count("\n") == 1 and flink.find_job(JOB_NAME)["jid"] == job["jid"]  # nothing stopped
        for parallelism in PARALLELISMS[1:]:
            with_parallelism(path, parallelism)
            restarted = cli(env, "restart", "-c", str(path), "--timeout", "110")
            assert restarted.returncode == 0, restarted.stdout + restarted.stderr
            assert restarted.stdout.splitlines()[-1].endswith(f"runs at parallelism {parallelism}"), restarted.stdout
            runs[-1]["results when the next ran"] = count_results(config, "read_committed")
            job = running_job(flink)
            runs.append({"parallelism": parallelism, "subtasks": subtasks(job)})
            time.sleep(SERVE_S)
        assert producer.result() == REQUESTS
        figures = check_all_answered_once(config, features, timeout=300)
        runs[-1]["results when the next ran"] = count_results(config, "read_committed")
        stopped = cli(env, "stop", "-c", str(path))
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        start.wait(60)
    finally:
        if start.poll() is None:
            start.kill()
    output = log.read_text(errors="replace")
    print(json.dumps({"runs": runs} | figures))
    assert [run["subtasks"] for run in runs] == [[1], [2], [4], [1]]
    assert output.count("restarting the job: a final savepoint") == 3, output[-3000:]
    assert output.count("restarting the job in this JVM") == 3, output[-3000:]  # not a new process
    assert output.count("resuming from the retained savepoint") == 3, output[-3000:]
    answered = [run["results when the next ran"] for run in runs]
    assert 0 < answered[0] < answered[1] < answered[2] < answered[3] == REQUESTS, f"a run served nothing, or results repeat: {answered}"
    assert figures["duplicates collapsed"] == 0
