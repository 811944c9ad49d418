"""Rescaling a running deployment: the job stopped with its final savepoint and started again at
another `flink.parallelism` (1 -> 2 -> 4 -> 1), under exactly_once, while clients keep sending.
The savepoint carries the Kafka positions, the micro-batcher's waiting requests and the routing
table to the new subtasks: every request is answered once, and a read_committed reader sees no
result twice."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import yaml

from cluster_serving.ops.children import EmbeddedJob
from cluster_serving.ops.sample_model import FEATURES
from tests.test_recovery import check_all_answered_once, count_results, send

REQUESTS = 20_000
RATE = 200  # requests a second: the stream lasts through every start and stop below
PARALLELISMS = (1, 2, 4, 1)
SERVE_S = 8  # each run serves this long after it is running, then stops with a savepoint


def with_parallelism(path: Path, parallelism: int) -> None:
    """The operator's config change: flink.parallelism in the config file."""
    raw = yaml.safe_load(path.read_text())
    raw["flink"]["parallelism"] = parallelism
    path.write_text(yaml.safe_dump(raw))


def test_rescale_1_2_4_1_under_exactly_once_loses_and_repeats_nothing(write_config, tmp_path: Path) -> None:
    path, config = write_config(kafka={"delivery": "exactly_once", "partitions": 4}, batching={"batch_size": 32, "max_delay_ms": 20})
    features = np.random.default_rng(12).normal(size=(REQUESTS, FEATURES)).astype(np.float32)
    producer = send(config, features, rate=RATE)
    runs = []
    for run, parallelism in enumerate(PARALLELISMS):
        with_parallelism(path, parallelism)
        job = EmbeddedJob(path, config.flink.rest_port, log_path=tmp_path / f"job-{run}.log")
        try:
            job.start()
            vertices = job.rest(f"/jobs/{job.job_id}")["vertices"]
            runs.append({"parallelism": parallelism, "subtasks": sorted({vertex["parallelism"] for vertex in vertices})})
            if run == len(PARALLELISMS) - 1:
                assert producer.result() == REQUESTS
                figures = check_all_answered_once(config, features, timeout=300)
            else:
                time.sleep(SERVE_S)
        finally:
            job.stop()
        runs[-1]["results after its stop"] = count_results(config, "read_committed")
        if run:
            assert "resuming from the retained savepoint" in job.log_text(), job.log_tail()
        assert "final savepoint" in job.log_text(), job.log_tail()
    print(json.dumps({"runs": runs} | figures))
    assert [run["subtasks"] for run in runs] == [[1], [2], [4], [1]]
    answered = [run["results after its stop"] for run in runs]
    assert 0 < answered[0] < answered[1] < answered[2] < answered[3] == REQUESTS, f"a run served nothing, or results repeat: {answered}"
    assert figures["duplicates collapsed"] == 0
