"""The serving job on a standalone Flink cluster, as a user runs one: `cluster-serving cluster up`
(the pip-installed PyFlink's start-cluster.sh), `submit` (`flink run -py`), `stop`, `status`, `down`, as
opposed to the embedded MiniCluster of the other end-to-end tests."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from cluster_serving.client import InputQueue, OutputQueue
from cluster_serving.config import ServingConfig
from cluster_serving.jvm import connector_jar
from cluster_serving.ops.children import HttpBridge
from cluster_serving.ops.cluster import StandaloneCluster
from cluster_serving.ops.processes import free_port
from cluster_serving.ops.sample_model import FEATURES
from bench.scale_out import requests_per_subtask
from tests.conftest import assert_served, http_call
from tests.test_broker_outage import PacedSender, longest_gap, read_until

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
        assert f", starting from the committed offsets of group {config.kafka.group_id}" in submitted.stdout
        assert cluster.rest.state(job_id) == "RUNNING"

        status = cluster_command("status", "--dir", str(folder))
        assert status.returncode == 0
        assert "2 TaskManager(s), 1 of 2 slots free" in status.stdout and f"job {job_id} cluster-serving: RUNNING" in status.stdout

        assert_served(config, COUNT, seed=7, timeout=90)
        # Restarted on the running cluster: a final savepoint, then the same job from it, with the
        # Kafka connector the TaskManagers loaded once from lib/. Every result comes once: a
        # result of the first run again would fail the second check (other inputs, same uris).
        assert (folder / "lib" / connector_jar().name).exists()
        stopped = cluster_command("stop", "--dir", str(folder), "-c", str(path))
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert f"job {job_id} stopped with a final savepoint" in stopped.stdout
        assert cluster.rest.state(job_id) == "FINISHED"
        again = cluster_command("stop", "--dir", str(folder), "-c", str(path))
        assert again.returncode == 2 and again.stderr.startswith("error: no running cluster-serving job to stop")
        resubmitted = cluster_command("submit", "--dir", str(folder), "-c", str(path))
        assert resubmitted.returncode == 0, resubmitted.stdout + resubmitted.stderr
        assert ", resuming from the retained savepoint " in resubmitted.stdout
        assert_served(config, COUNT, seed=8, timeout=90)
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


@contextmanager
def job_on_two_taskmanagers(tmp_path: Path, write_config, parallelism: int, partitions: int) -> Iterator[tuple[StandaloneCluster, ServingConfig, str]]:
    """The job submitted at `parallelism` to two TaskManagers of two slots each, running with its
    subtasks on both; the cluster stops at the end."""
    folder, rest_port = tmp_path / "flink", free_port()
    path, config = write_config(flink={"rest_port": rest_port, "parallelism": parallelism}, kafka={"partitions": partitions})
    cluster = StandaloneCluster(rest_port, folder, task_slots=2, taskmanagers=2)
    cluster.start()
    try:
        job_id, _ = cluster.submit(path)
        cluster.rest.wait_until_running(job_id, 120)
        assert len(job_data_ports(cluster, job_id)) == 2, "the subtasks are not on both TaskManagers"
        yield cluster, config, job_id
    finally:
        cluster.stop()


def test_a_taskmanager_sigkilled_mid_stream_loses_nothing(tmp_path: Path, write_config) -> None:
    """Parallelism 2 over two TaskManagers of two slots each; one is SIGKILLed while requests flow,
    and the job restarts the lost subtask from its last checkpoint on the other's free slot."""
    with job_on_two_taskmanagers(tmp_path, write_config, parallelism=2, partitions=2) as (cluster, config, job_id):
        count, rate = 4_000, 200
        inputs = InputQueue(config.kafka.bootstrap_servers, config.kafka.input_topic)
        outputs = OutputQueue(config.kafka.bootstrap_servers, config.kafka.result_topic, group_id="tm-client")
        seen: dict[str, float] = {}
        with inputs, outputs:
            sender = PacedSender(inputs, count, rate)
            reader = threading.Thread(target=read_until, args=(outputs, count, 300, seen), daemon=True)
            sender.start()
            reader.start()
            time.sleep(6)
            victim = busy_taskmanager(cluster, job_id)
            victim.kill()
            killed = time.monotonic()
            sender.join(300)
            reader.join(300)
            assert sender.error is None, sender.error
        after = sorted(arrival for arrival in seen.values() if arrival > killed)
        gap = longest_gap(list(seen.values()))
        print(f"TaskManager SIGKILL: {len(seen)} of {count} answered, results paused at most {gap:.1f} s, "
              f"{outputs.store.duplicates} duplicates (at least once)")
        assert len(seen) == count, f"{count - len(seen)} lost"
        assert after, "nothing was answered after the kill"
        history = cluster.rest.get(f"/jobs/{job_id}/exceptions")
        assert history["exceptionHistory"]["entries"], "the job saw no failure: the kill tested nothing"
        assert cluster.rest.state(job_id) == "RUNNING"


def job_data_ports(cluster: StandaloneCluster, job_id: str) -> set[int]:
    """The data ports of the TaskManagers that run the job's (one, chained) vertex, as Flink's REST API names them."""
    (vertex,) = cluster.rest.job(job_id)["vertices"]
    managers = cluster.rest.get(f"/jobs/{job_id}/vertices/{vertex['id']}/taskmanagers")["taskmanagers"]
    return {int(manager["endpoint"].rpartition(":")[2]) for manager in managers}


def busy_taskmanager(cluster: StandaloneCluster, job_id: str) -> psutil.Process:
    """The process of a TaskManager that runs a subtask of the job: the one listening on its data port."""
    ports = job_data_ports(cluster, job_id)
    for pid in cluster.processes():
        process = psutil.Process(pid)
        if any("TaskManagerRunner" in part for part in process.cmdline()) and any(
            connection.status == psutil.CONN_LISTEN and connection.laddr.port in ports for connection in process.net_connections("tcp")
        ):
            return process
    raise AssertionError(f"no TaskManager process listens on {sorted(ports)}")


def test_parallelism_four_over_two_taskmanagers_serves_from_every_subtask(tmp_path: Path, write_config) -> None:
    """Two TaskManagers of two slots, the job at parallelism 4 over 8 partitions: its subtasks on
    both TaskManagers, every request answered once, and every subtask took a share of them."""
    with job_on_two_taskmanagers(tmp_path, write_config, parallelism=4, partitions=8) as (cluster, config, job_id):
        started = time.monotonic()
        assert_served(config, 4_000, seed=13, timeout=180)
        served_s = time.monotonic() - started
        counts = requests_per_subtask(cluster.rest.get, job_id, 4, 4_000)
    print(f"parallelism 4 over 2 TaskManagers: 4,000 requests answered in {served_s:.1f} s, per subtask {counts}")
    # numRecordsIn counts the routing table's control record too, one per subtask or more.
    assert sum(counts) >= 4_000 and all(count > 0 for count in counts), f"requests per subtask: {counts}"
