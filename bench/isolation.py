"""`python -m bench.isolation`: two models in one job, the fast one paced, the slow one flooded.

One job (parallelism 1) serves a repository of two models on the local broker:
- `fast`, the bench's MLP (the default model), batches of 32;
- `slow`, a model of the MLP's inputs and outputs that takes about --slow-ms per batch (--slow-kind
  cpu: a MatMul on one ONNX Runtime thread, bench/models.py build_slow; wait: the MLP behind a
  preprocess function that sleeps that long, as a model on a GPU leaves its host thread waiting),
  batches of 32 (max_delay_ms 10), `max_queue_size` --slow-queue (0: no bound, left out of its
  servable.yaml, so that an older job reads it too).
The run: a warm-up drain of the fast model, three running drains for its capacity (the median:
single drains on the 2-core machine ranged from 62,000 to 110,000 req/s in one evening), then the
fast model paced at half that capacity (or --rate; LATENCY_WARMUP_S untimed, --seconds timed)
alone, again while a process floods the slow model at --flood-rate (default: three times what it
can serve), and alone once more, so that drift shows. Printed (and with --json, written): the fast
model's latency in each phase, the flooded p99 over the mean of the two alone, and what became of
every flooded request (served, refused `overloaded`, never answered).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from bench.kafka_load import ResultReader
from bench.models import bench_models, build_slow
from bench.report import group_cpu_seconds, json_safe, machine
from bench.run import BROKER_TIMESTAMPS, DEFAULT_HIDDEN, LATENCY_WARMUP_S, paced_latency, progress, running_drain
from cluster_serving.client import InputQueue
from cluster_serving.config import ServingConfig, load_config
from cluster_serving.kafka.admin import ensure_topics
from cluster_serving.kafka.librdkafka import paced
from cluster_serving.ops.children import EmbeddedJob, LocalBroker
from cluster_serving.ops.processes import free_port, write_run_config

BATCH = 32
SLOW_DELAY_MS = 10
CAPACITY_REQUESTS = 100_000
SLEEPING_STAGE = """import time


def sleep_a_while(inputs):
    time.sleep({seconds})
    return inputs
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.isolation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--slow-ms", type=float, default=50.0, help="the slow model's time per batch of 32")
    parser.add_argument("--slow-kind", choices=["cpu", "wait"], default="cpu", help="what makes it slow (see above)")
    parser.add_argument("--slow-queue", type=int, default=2 * BATCH, help="its max_queue_size (0: no bound)")
    parser.add_argument("--rate", type=float, default=0.0, help="fast requests per second (0: half its capacity)")
    parser.add_argument("--flood-rate", type=float, default=0.0, help="slow requests per second (0: 3x its capacity)")
    parser.add_argument("--seconds", type=float, default=30.0, help="timed seconds of each paced phase")
    parser.add_argument("--json", type=Path, help="also write the figures to this file as JSON")
    return parser.parse_args(argv)


def repository(folder: Path, args: argparse.Namespace) -> Path:
    """fast/1 (the MLP) and slow/1, each with its servable.yaml."""
    root = folder / "repository"
    mlp = bench_models(DEFAULT_HIDDEN)["mlp"]
    (root / "fast" / "1").mkdir(parents=True)
    mlp.build(root / "fast" / "1" / "model.onnx")
    (root / "fast" / "servable.yaml").write_text(yaml.safe_dump({"batching": {"batch_size": BATCH, "max_delay_ms": 0}}))
    (root / "slow" / "1").mkdir(parents=True)
    slow: dict[str, Any] = {"batching": {"batch_size": BATCH, "max_delay_ms": SLOW_DELAY_MS}}
    if args.slow_queue:
        slow["max_queue_size"] = args.slow_queue
    if args.slow_kind == "cpu":
        build_slow(root / "slow" / "1" / "model.onnx", args.slow_ms, BATCH)
    else:
        shutil.copyfile(root / "fast" / "1" / "model.onnx", root / "slow" / "1" / "model.onnx")
        (root / "slow" / "servable.py").write_text(SLEEPING_STAGE.format(seconds=args.slow_ms / 1000))
        slow["preprocess"] = {"function": "sleep_a_while", "batched": True}
    (root / "slow" / "servable.yaml").write_text(yaml.safe_dump(slow))
    return root


def flood(bootstrap: str, topic: str, count: int, rate: float, samples: np.ndarray, done: multiprocessing.Queue) -> None:
    """Sends `count` requests to model `slow` at `rate` a second (a process of its own)."""
    with InputQueue(bootstrap, topic) as inputs:
        for i in paced(count, rate):
            inputs.enqueue(f"slow-{i}", model="slow", features=samples[i % len(samples)])
        inputs.flush(60)
    done.put(count)


def fast_phase(config: ServingConfig, reader: ResultReader, rate: float, label: str, seconds: float) -> dict[str, Any]:
    mlp = bench_models(DEFAULT_HIDDEN)["mlp"]
    warmup = [f"{label}-warmup-{i}" for i in range(round(rate * LATENCY_WARMUP_S))]
    uris = [f"{label}-{i}" for i in range(round(rate * seconds))]
    figures = paced_latency(config, reader, mlp, mlp.samples(64), rate, warmup, uris)
    return {key: figures[key] for key in ("rate", "sent_rate", "requests", "p50_ms", "p95_ms", "p99_ms", "job_share")} | {
        "missing": sum(uri not in reader.arrivals for uri in uris)}


def measure(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    broker = LocalBroker(folder / "kafka", port=free_port(), log_path=folder / "broker.log")
    progress("broker", "starting the local Kafka broker ...")
    broker.start()
    try:
        progress("models", f"building the repository (slow: {args.slow_kind}, about {args.slow_ms:g} ms per batch) ...")
        root = repository(folder, args)
        path = write_run_config(folder, root / "fast" / "1" / "model.onnx", broker.bootstrap_servers,
                                models={"repository": str(root), "default": "fast"}, flink={"parallelism": 1})
        config = load_config(path)
        ensure_topics(config.kafka, topic_configs=BROKER_TIMESTAMPS)
        reader = ResultReader(broker.bootstrap_servers, config.kafka.result_topic)
        job = EmbeddedJob(path, config.flink.rest_port, folder / "job.log")
        try:
            progress("job", "starting the job ...")
            job.start()
            return run_phases(config, reader, job, args)
        finally:
            job.stop()
            reader.close()
    finally:
        broker.stop()


def run_phases(config: ServingConfig, reader: ResultReader, job: EmbeddedJob, args: argparse.Namespace) -> dict[str, Any]:
    mlp = bench_models(DEFAULT_HIDDEN)["mlp"]
    samples = mlp.samples(64)
    running_drain(config, reader, job, mlp, samples, [f"jit-{i}" for i in range(CAPACITY_REQUESTS)])
    drains = [running_drain(config, reader, job, mlp, samples, [f"capacity{n}-{i}" for i in range(CAPACITY_REQUESTS)])
              for n in range(3)]
    capacity, writer_bound, cpu_us = sorted(drains)[1]
    rate = args.rate or capacity / 2
    alone = fast_phase(config, reader, rate, "alone", args.seconds)
    slow_capacity = BATCH / (args.slow_ms / 1000)
    flood_rate = args.flood_rate or 3 * slow_capacity
    count = round(flood_rate * (LATENCY_WARMUP_S + args.seconds + 5))
    progress("slow", f"flooding the slow model: {count} requests at {flood_rate:,.0f} req/s (it serves about "
                     f"{slow_capacity:,.0f}) while the fast one is paced again ...")
    context = multiprocessing.get_context("spawn")
    done = context.Queue()
    flooder = context.Process(target=flood, args=(config.kafka.bootstrap_servers, config.kafka.input_topic, count,
                                                  flood_rate, samples, done))
    cpu = group_cpu_seconds(job.process.pid)
    flooder.start()
    time.sleep(2)  # the slow model's queue fills first
    flooded = fast_phase(config, reader, rate, "flooded", args.seconds)
    cpu_share = (group_cpu_seconds(job.process.pid) - cpu)
    done.get(timeout=600)
    flooder.join()
    slow_uris = [f"slow-{i}" for i in range(count)]
    reader.read_until(slow_uris, timeout=120 + count / slow_capacity)
    arrived = [reader.arrivals[uri] for uri in slow_uris if uri in reader.arrivals]
    after = fast_phase(config, reader, rate, "after", args.seconds)
    return {
        "machine": machine("CPUExecutionProvider"),
        "settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        "fast_capacity": capacity, "capacity_drains": [drain[0] for drain in drains],
        "capacity_writer_bound": writer_bound, "job_cpu_us_per_request": cpu_us,
        "fast_alone": alone, "fast_flooded": flooded, "fast_alone_after": after,
        "p99_flooded_over_alone": flooded["p99_ms"] / ((alone["p99_ms"] + after["p99_ms"]) / 2),
        "slow": {"sent": count, "rate": flood_rate, "capacity_estimate": slow_capacity,
                 "served": sum(not arrival.error for arrival in arrived),
                 "refused": sum(arrival.error for arrival in arrived),
                 "missing": count - len(arrived)},
        "job_cpu_seconds_flooded_phase": cpu_share,
    }


def table(report: dict[str, Any]) -> str:
    slow = report["slow"]
    drains = ", ".join(f"{rate:,.0f}" for rate in report["capacity_drains"])
    lines = [f"fast model (MLP): capacity {report['fast_capacity']:,.0f} req/s (median of {drains}); "
             f"paced at {report['fast_alone']['rate']:,.0f} req/s"]
    for label, key in (("alone", "fast_alone"), ("flooded", "fast_flooded"), ("alone again", "fast_alone_after")):
        phase = report[key]
        lines.append(f"  {label + ':':12} p50 {phase['p50_ms']:.1f} ms, p95 {phase['p95_ms']:.1f} ms, p99 {phase['p99_ms']:.1f} ms"
                     f" (job's share p99 {phase['job_share']['p99_ms']:.1f} ms), sent {phase['sent_rate']:,.0f} req/s, {phase['missing']} missing")
    lines += [
        f"  p99 flooded / alone (mean of both): {report['p99_flooded_over_alone']:.2f}",
        f"slow model ({report['settings']['slow_kind']}, {report['settings']['slow_ms']:g} ms per batch, max_queue_size "
        f"{report['settings']['slow_queue']}): {slow['sent']:,} sent at {slow['rate']:,.0f} req/s, {slow['served']:,} served, "
        f"{slow['refused']:,} refused (overloaded), {slow['missing']:,} never answered",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cs-isolation-") as name:
        report = measure(Path(name), args)
    report["ok"] = report["slow"]["missing"] == 0 and not any(report[key]["missing"] for key in ("fast_alone", "fast_flooded", "fast_alone_after"))
    print(table(report))
    if args.json:
        args.json.write_text(json.dumps(json_safe(report), indent=1) + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
