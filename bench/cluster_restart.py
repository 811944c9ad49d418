"""`python -m bench.cluster_restart`: the MLP job restarted on a running standalone Flink cluster,
beside the same job's first start in a new JVM and the plain librdkafka loop, one run.

On one broker and one cluster (one TaskManager), over one input topic:
1. the plain consumer loops (bench/baseline.py) drain the backlog, alone: the reference;
2. the job is submitted on the same backlog (in requests): its first start, in a new TaskManager
   JVM, what `cluster-serving bench` calls right after start;
3. --running-drains backlogs written while it runs, so that the JIT has compiled the path;
4. --restarts times: the job stopped with a final savepoint (`cluster-serving cluster stop`), a
   backlog written, the job submitted again (`cluster submit`), its drain right after the restart,
   then one drain while it runs;
5. once more stopped and submitted again, paced at --rate from the moment its tasks run for
   --first-seconds: latency per FIRST_MINUTE_WINDOW_S, as `cluster-serving bench` shows a new JVM's.
Drains are timed as the main bench times them: the broker's append stamps of the results, a drain
after a start past its first tenth. The TaskManager keeps its JVM across the restarts, and with it
the code the JIT compiled for Flink, the Kafka connector (in the cluster's lib/) and the JDK.

    python -m bench.cluster_restart [--partitions 1] [--restarts 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bench.kafka_load import ResultReader
from bench.models import BenchModel, bench_models
from bench.run import (
    BROKER_TIMESTAMPS,
    DEFAULT_HIDDEN,
    DRAIN_TIMEOUT_S,
    FIRST_MINUTE_WINDOW_S,
    LATENCY_MAX_RATE,
    enqueue_batch_all,
    paced_latency,
    plain_loop_capacities,
    plain_loop_rates,
    progress,
)
from cluster_serving.config import ServingConfig, load_config
from cluster_serving.kafka.admin import ensure_topics
from cluster_serving.ops.children import LocalBroker
from cluster_serving.ops.cluster import StandaloneCluster
from cluster_serving.ops.processes import free_port, write_run_config

MODEL = "mlp"


class ClusterJob:
    """The serving job of one config on the cluster: submitted, stopped with a final savepoint,
    submitted again (resuming from it)."""

    def __init__(self, cluster: StandaloneCluster, config: ServingConfig):
        self.cluster = cluster
        self.config = config
        self.job_id = ""

    def submit(self) -> None:
        self.job_id, start = self.cluster.submit(self.config.source)
        self.cluster.rest.wait_until_running(self.job_id, 180)
        progress(MODEL, f"job {self.job_id} running, {start}")

    def stop(self) -> None:
        self.cluster.rest.stop_with_savepoint(self.job_id, self.config.flink.savepoint_dir.as_uri())


def drain_rate(job: ClusterJob, reader: ResultReader, uris: list[str], before: int, skipped: int = 0) -> float:
    """Waits for the results of `uris`, the ones after the `before` already on the result topic,
    and times them past the first `skipped`."""
    if not reader.wait_for(before + len(uris), lambda: True, DRAIN_TIMEOUT_S):
        raise RuntimeError(f"job {job.job_id} did not answer {len(uris)} requests")
    reader.read_until(uris, DRAIN_TIMEOUT_S)
    return reader.drain_rate(before + skipped, before + len(uris))


def drain_after_start(job: ClusterJob, reader: ResultReader, model: BenchModel, samples: np.ndarray,
                      uris: list[str], warmup: int) -> float:
    """Writes `uris` while the job is stopped, submits it, and times its drain past `warmup`."""
    before = reader.written()
    enqueue_batch_all(job.config, uris, model.input_name, samples)
    job.submit()
    return drain_rate(job, reader, uris, before, warmup)


def drain_while_running(job: ClusterJob, reader: ResultReader, model: BenchModel, samples: np.ndarray,
                        uris: list[str]) -> float:
    """A backlog written in one Kafka transaction while the job runs, timed from its first result."""
    before = reader.written()
    enqueue_batch_all(job.config, uris, model.input_name, samples, transactional_id="cs-bench-restart")
    return drain_rate(job, reader, uris, before)


def measure(job: ClusterJob, reader: ResultReader, model: BenchModel, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    samples = model.samples(64)
    warmup = args.requests // 10
    first = [f"first-{i}" for i in range(warmup + args.requests)]
    enqueue_batch_all(job.config, first, model.input_name, samples)
    loops = plain_loop_capacities(plain_loop_rates(job.config, model, samples, first, warmup, folder))
    progress(MODEL, "the job's first start, on that backlog ...")
    before = reader.written()
    job.submit()
    first_start = drain_rate(job, reader, first, before, warmup)
    running = []
    for drain in range(args.running_drains):
        progress(MODEL, f"drain {drain + 1} of {args.running_drains} while it runs ...")
        running.append(drain_while_running(job, reader, model, samples, [f"running-{drain}-{i}" for i in range(args.requests)]))
    restarts = []
    for restart in range(args.restarts):
        progress(MODEL, f"restart {restart + 1} of {args.restarts}: a final savepoint, a backlog, the job again ...")
        job.stop()
        after = drain_after_start(job, reader, model, samples, [f"restart-{restart}-{i}" for i in range(warmup + args.requests)], warmup)
        then = drain_while_running(job, reader, model, samples, [f"after-{restart}-{i}" for i in range(args.requests)])
        restarts.append({"right_after_restart": after, "running_after": then})
    progress(MODEL, f"restarted once more, paced at {args.rate:,.0f} req/s from its start for {args.first_seconds:g} s ...")
    job.stop()
    job.submit()
    paced = [f"paced-{i}" for i in range(round(args.rate * args.first_seconds))]
    latency = paced_latency(job.config, reader, model, samples, args.rate, [], paced, FIRST_MINUTE_WINDOW_S)
    return {"plain_loop": loops, "first_start": first_start, "running_drains": running, "restarts": restarts,
            "paced_after_restart": latency, "missing": sum(uri not in reader.arrivals for uri in paced)}


def report(figures: dict[str, Any], args: argparse.Namespace) -> None:
    loop = figures["plain_loop"]["librdkafka"]
    after = [restart["right_after_restart"] for restart in figures["restarts"]]
    print(f"the MLP job on a standalone cluster, {args.partitions} partition(s), backlogs of {args.requests:,}; "
          f"plain loop on librdkafka {loop:,.0f} req/s")
    print(f"  first start (a new JVM): {figures['first_start']:,.0f} req/s ({figures['first_start'] / loop:.3f} of the loop)")
    print("  running drains: " + ", ".join(f"{rate:,.0f}" for rate in figures["running_drains"]))
    print("  right after a restart on the running cluster: " + ", ".join(f"{rate:,.0f} ({rate / loop:.3f})" for rate in after)
          + f"; median {statistics.median(after) / loop:.3f} of the loop")
    print("  a drain while running after each: " + ", ".join(f"{r['running_after']:,.0f}" for r in figures["restarts"]))
    paced = figures["paced_after_restart"]
    windows = ", ".join(f"{window['job_share']['p99_ms']:.0f}" for window in paced["windows"])
    print(f"  restarted and paced at {paced['sent_rate']:,.0f} req/s: p50 {paced['p50_ms']:.0f} / p99 {paced['p99_ms']:.0f} ms; "
          f"the job's share p99 per {FIRST_MINUTE_WINDOW_S:g} s: {windows} ms; missing {figures['missing']}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster_restart", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200_000, help="each backlog (a tenth more before a start's)")
    parser.add_argument("--partitions", type=int, default=1, help="of the input topic")
    parser.add_argument("--running-drains", type=int, default=6, help="drains while the first job runs")
    parser.add_argument("--restarts", type=int, default=3, help="stops and submissions, each drained right after")
    parser.add_argument("--rate", type=float, default=LATENCY_MAX_RATE, help="requests per second after the last restart")
    parser.add_argument("--first-seconds", type=float, default=60.0, help="how long it is paced, from its start")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = bench_models(hidden=DEFAULT_HIDDEN)[MODEL]
    with tempfile.TemporaryDirectory(prefix="cluster-restart-bench-") as scratch:
        folder = Path(scratch)
        model_path = model.build(folder / f"{MODEL}.onnx")
        cluster = StandaloneCluster(free_port(), folder / "flink", task_slots=2)
        with LocalBroker(folder / "kafka", port=free_port(), log_path=folder / "broker.log") as broker:
            path = write_run_config(folder, model_path, broker.bootstrap_servers, batching={"run_batch_size": model.run_batch_size},
                                    flink={"rest_port": cluster.rest_port}, kafka={"partitions": args.partitions})
            config = load_config(path)
            ensure_topics(config.kafka, topic_configs=BROKER_TIMESTAMPS)
            cluster.start()
            reader = ResultReader(config.kafka.bootstrap_servers, config.kafka.result_topic)
            try:
                figures = measure(ClusterJob(cluster, config), reader, model, folder, args)
            finally:
                reader.close()
                cluster.stop()
    report(figures, args)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
