"""The whole pipeline on real parts: broker process, embedded PyFlink job, client library."""

from __future__ import annotations

import re
import subprocess

import numpy as np
import psutil
import pytest
from kafka import KafkaProducer

from cluster_serving.client import InputQueue, OutputQueue
from cluster_serving.ops.processes import process_group_members
from cluster_serving.ops.sample_model import FEATURES
from tests.conftest import assert_served, collect

COUNT = 2000


@pytest.mark.parametrize("run_batch_size", [0, 5])
def test_two_thousand_requests_match_onnxruntime(write_config, start_job, run_batch_size: int) -> None:
    """Batches of up to 32 in one ONNX Runtime run each, or in runs of 5 (batching.run_batch_size)."""
    path, config = write_config(batching={"batch_size": 32, "max_delay_ms": 20, "run_batch_size": run_batch_size})
    start_job(path, config)
    assert_served(config, COUNT, seed=42, timeout=120)


def test_bad_requests_get_error_results_and_others_still_run(write_config, start_job) -> None:
    path, config = write_config()
    start_job(path, config)
    kafka = config.kafka
    with InputQueue(kafka.bootstrap_servers, kafka.input_topic) as inputs, OutputQueue(
        kafka.bootstrap_servers, kafka.result_topic, group_id=f"{kafka.group_id}-client"
    ) as outputs:
        inputs.enqueue("wrong-shape", features=np.ones(FEATURES + 1, np.float32))
        inputs.enqueue("wrong-name", pixels=np.ones(FEATURES, np.float32))
        raw = KafkaProducer(bootstrap_servers=kafka.bootstrap_servers)
        raw.send(kafka.input_topic, key=b"garbage", value=b"\x00not arrow at all")
        raw.close()
        inputs.enqueue("good", features=np.ones(FEATURES, np.float32))
        inputs.flush()
        good = outputs.query("good", timeout=60)
        assert good is not None and good["probabilities"].shape == (10,)
        assert "does not fit" in outputs.query("wrong-shape", timeout=10)["error"]
        assert "unknown input 'pixels'" in outputs.query("wrong-name", timeout=10)["error"]
        assert outputs.query("garbage", timeout=10)["error"].startswith("bad request: not a cluster-serving message")
    flink_log = "".join(log.read_text(errors="replace") for log in (path.parent / "log").glob("*.log"))
    for uri in ("wrong-shape", "wrong-name", "garbage"):
        assert f"uri={uri} " in flink_log, f"no log line names uri={uri}"


def test_jvm_options_start_the_embedded_cluster(write_config, start_job) -> None:
    """flink.jvm_options reach the embedded cluster's JVM, here with C1 as its only JIT compiler,
    and the job serves as before."""
    options = ["-XX:TieredStopAtLevel=1", "-Dcluster.serving.check=jvm-options"]
    path, config = write_config(flink={"jvm_options": options})
    job = start_job(path, config)
    assert_served(config, 500, seed=7, timeout=120)
    command_lines = [psutil.Process(pid).cmdline() for pid in process_group_members(job.process.pid)]
    java = [line for line in command_lines if line and line[0].endswith("java")]
    assert len(java) == 1 and set(options) <= set(java[0]), command_lines


def listening_addresses(pids: set[int]) -> list[str]:
    """Local addresses of TCP listeners owned by `pids`, from `ss`."""
    lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout.splitlines()
    return [line.split()[3] for line in lines if set(map(int, re.findall(r"pid=(\d+)", line))) & pids]


def test_job_and_broker_listen_on_loopback_only(broker, write_config, start_job) -> None:
    path, config = write_config()
    job = start_job(path, config)
    pids = process_group_members(job.process.pid) | process_group_members(broker.process.pid)
    addresses = listening_addresses(pids)
    assert any(address.endswith(f":{config.flink.rest_port}") for address in addresses), addresses
    assert all(address.startswith(("127.", "[::ffff:127.", "[::1]")) for address in addresses), addresses


def test_requests_in_a_transaction_are_served_once_committed_and_never_when_aborted(write_config, start_job) -> None:
    """The job reads committed requests only: an open transaction's wait for its commit, an
    aborted one's are never served, and a plain request behind them is (one partition: in order)."""
    path, config = write_config()
    start_job(path, config)
    kafka = config.kafka
    one = np.ones(FEATURES, np.float32)
    with InputQueue(kafka.bootstrap_servers, kafka.input_topic, transactional_id=f"{kafka.group_id}-writer") as atomic, \
            InputQueue(kafka.bootstrap_servers, kafka.input_topic) as plain, \
            OutputQueue(kafka.bootstrap_servers, kafka.result_topic, group_id=f"{kafka.group_id}-client") as outputs:
        plain.enqueue("first", features=one)
        plain.flush()
        assert outputs.query("first", timeout=60) is not None
        with atomic.transaction():
            atomic.enqueue_batch([("kept-1", {"features": one}), ("kept-2", {"features": one})])
            assert outputs.query("kept-1", timeout=3) is None, "a request of an open transaction was served"
        with pytest.raises(KeyError), atomic.transaction():
            atomic.enqueue("dropped", features=one)
            atomic.flush()
            raise KeyError("the writer changes its mind")
        plain.enqueue("after", features=one)
        plain.flush()
        results = collect(outputs, 0, 60, uris={"kept-1", "kept-2", "after"})
        assert {"kept-1", "kept-2", "after"} <= results.keys()
        assert "dropped" not in results | outputs.dequeue()
        with pytest.raises(RuntimeError, match="transaction"):
            atomic.enqueue("outside", features=one)
