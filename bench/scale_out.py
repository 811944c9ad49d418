"""`python -m bench.scale_out`: the job on a standalone Flink cluster of several TaskManagers at
parallelism 1, 2 and 4, each run draining the same backlog of MLP requests on a topic of its own:
requests/s, and each subtask's share (Flink's numRecordsIn of the micro-batcher, per subtask).

The backlog is written before the job is submitted, and the rate is timed from the broker's append
times of the results (LogAppendTime), past the first tenth of them (the warm-up). The cluster and the broker run
on this machine, as `cluster-serving cluster up --taskmanagers 2` runs them: the figures say what
more subtasks give where the cores are shared, not what more machines give.

    python -m bench.scale_out [--requests 200000] [--parallelism 1,2,4] [--taskmanagers 2] [--task-slots 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.kafka_load import ResultReader
from bench.run import BROKER_TIMESTAMPS, DRAIN_TIMEOUT_S, enqueue_batch_all, progress
from cluster_serving.config import load_config
from cluster_serving.kafka.admin import ensure_topics
from cluster_serving.ops.children import LocalBroker
from cluster_serving.ops.cluster import StandaloneCluster
from cluster_serving.ops.processes import free_port, write_run_config
from cluster_serving.ops.sample_model import FEATURES, build_sample_model


def requests_per_subtask(get: Callable[[str], Any], job_id: str, parallelism: int, total: int) -> list[int]:
    """How many records each subtask of the job's micro-batcher took in (its routing table's
    control records among them), read from Flink's REST API (`get(path)`), once they add up to
    `total` or 30 s passed: the metrics are seconds old. The batcher is chained to the source: its
    own input count, per subtask, says where the requests went."""
    chain = next(vertex for vertex in get(f"/jobs/{job_id}")["vertices"] if "micro-batch" in vertex["name"])
    ids = [f"{subtask}.micro-batch.numRecordsIn" for subtask in range(parallelism)]
    url = f"/jobs/{job_id}/vertices/{chain['id']}/metrics?get={','.join(ids)}"
    deadline = time.monotonic() + 30
    while True:
        metrics = {metric["id"]: metric.get("value") for metric in get(url)}
        counts = [int(metrics.get(name) or 0) for name in ids]
        if sum(counts) >= total or time.monotonic() > deadline:
            return counts
        time.sleep(1)


def one_run(cluster: StandaloneCluster, folder: Path, model: Path, bootstrap: str, parallelism: int,
            args: argparse.Namespace) -> dict[str, Any]:
    """The job at `parallelism` draining a backlog of its own; the job is cancelled after it."""
    path = write_run_config(folder, model, bootstrap, flink={"rest_port": cluster.rest_port, "parallelism": parallelism},
                            kafka={"partitions": args.partitions}, batching={"batch_size": args.batch_size})
    config = load_config(path)
    ensure_topics(config.kafka, topic_configs=BROKER_TIMESTAMPS)
    samples = np.random.default_rng(parallelism).normal(size=(1000, FEATURES)).astype(np.float32)
    warmup = args.requests // 10
    progress(f"parallelism {parallelism}", f"a backlog of {args.requests} requests, then the job ...")
    uris = [f"p{parallelism}-{i}" for i in range(args.requests)]
    enqueue_batch_all(config, uris, "features", samples)
    reader = ResultReader(config.kafka.bootstrap_servers, config.kafka.result_topic)
    job_id, _ = cluster.submit(path)
    try:
        cluster.rest.wait_until_running(job_id, 180)
        reader.read_until(uris, DRAIN_TIMEOUT_S)
        counts = requests_per_subtask(cluster.rest.get, job_id, parallelism, args.requests)
    finally:
        cluster.rest.cancel(job_id)
        reader.close()
    if len(reader.arrivals) < len(uris):
        raise RuntimeError(f"the job at parallelism {parallelism} answered {len(reader.arrivals)} of {len(uris)} requests")
    appended = sorted(arrival.appended_ms for arrival in reader.arrivals.values())
    rate = (len(appended) - warmup) / max((appended[-1] - appended[warmup]) / 1000, 0.001)
    return {"parallelism": parallelism, "requests_per_s": rate, "records_per_subtask": counts}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.scale_out", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200_000, help="the backlog of each run")
    parser.add_argument("--parallelism", default="1,2,4", help="a run at each, comma separated")
    parser.add_argument("--taskmanagers", type=int, default=2)
    parser.add_argument("--task-slots", type=int, default=2, help="slots per TaskManager")
    parser.add_argument("--partitions", type=int, default=8, help="of each run's input topic")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--json", type=Path, help="also write the runs as JSON here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="scale-out-bench-") as scratch:
        folder = Path(scratch)
        model = build_sample_model(folder / "model.onnx")
        cluster = StandaloneCluster(free_port(), folder / "flink", task_slots=args.task_slots, taskmanagers=args.taskmanagers)
        with LocalBroker(folder / "kafka", port=free_port(), log_path=folder / "broker.log") as broker:
            cluster.start()
            try:
                runs = [one_run(cluster, folder, model, broker.bootstrap_servers, int(p), args) for p in args.parallelism.split(",")]
            finally:
                cluster.stop()
    print(f"the job on {args.taskmanagers} TaskManagers of {args.task_slots} slots, MLP, {args.requests} requests a run:")
    for run in runs:
        shown = ", ".join(f"{count:,}" for count in run["records_per_subtask"])
        print(f"  parallelism {run['parallelism']}: {run['requests_per_s']:,.0f} req/s "
              f"({run['requests_per_s'] / runs[0]['requests_per_s']:.2f}x the first); records per subtask {shown}")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
