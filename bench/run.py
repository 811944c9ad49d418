"""End-to-end benchmark: the serving job against raw ONNX Runtime on the same model, in one run.

    cluster-serving bench --requests 5000 --batch-size 32 --hidden 256

Starts a local broker (unless --bootstrap names a Kafka) and the embedded job, sends a warm-up,
then enqueues N requests through InputQueue as fast as it can (or at --rate per second), reads
the result topic and prints throughput, latency percentiles (enqueue -> result read), and raw
ONNX Runtime throughput at the same batch size, with the ratio of the two.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import yaml
from kafka import KafkaConsumer, TopicPartition

from client.processes import EmbeddedJob, LocalBroker, free_port
from client.queues import InputQueue
from conf import load_config
from conf.sample_model import FEATURES, build_sample_model
from connectors.codec import decode_message
from job.model import open_session


@dataclass
class Figures:
    requests: int
    seconds: float
    latencies_ms: np.ndarray
    errors: int

    @property
    def throughput(self) -> float:
        return self.requests / self.seconds


def raw_onnxruntime(session: ort.InferenceSession, batch_size: int, requests: int) -> float:
    """Requests per second of a plain InferenceSession fed ready batches (no Kafka, no Flink)."""
    batch = np.random.default_rng(1).normal(size=(batch_size, FEATURES)).astype(np.float32)
    for _ in range(20):
        session.run(None, {"features": batch})
    runs = max(1, requests // batch_size)
    started = time.perf_counter()
    for _ in range(runs):
        session.run(None, {"features": batch})
    return runs * batch_size / (time.perf_counter() - started)


def read_results(consumer: KafkaConsumer, arrivals: dict[str, float], expected: int, timeout: float) -> int:
    """Stamps each result's arrival time; returns the number of error results."""
    errors = 0
    deadline = time.monotonic() + timeout
    while len(arrivals) < expected and time.monotonic() < deadline:
        for records in consumer.poll(timeout_ms=100).values():
            now = time.perf_counter()
            for record in records:
                message = decode_message(record.value, 1 << 28)
                arrivals.setdefault(message.uri, now)
                errors += message.error is not None
    return errors


def send(inputs: InputQueue, uris: list[str], features: np.ndarray, rate: float, sent: dict[str, float]) -> None:
    interval = 1.0 / rate if rate else 0.0
    started = time.perf_counter()
    for i, uri in enumerate(uris):
        if interval:
            time.sleep(max(0.0, started + i * interval - time.perf_counter()))
        sent[uri] = time.perf_counter()
        inputs.enqueue(uri, features=features[i])
    inputs.flush()


def run_load(bootstrap: str, config_path: Path, prefix: str, requests: int, rate: float) -> Figures:
    config = load_config(config_path)
    kafka = config.kafka
    features = np.random.default_rng(0).normal(size=(requests, FEATURES)).astype(np.float32)
    uris = [f"{prefix}-{i}" for i in range(requests)]
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, fetch_max_wait_ms=10)
    partitions = [TopicPartition(kafka.result_topic, p) for p in consumer.partitions_for_topic(kafka.result_topic)]
    consumer.assign(partitions)
    consumer.seek_to_end()
    for partition in partitions:
        consumer.position(partition)
    sent: dict[str, float] = {}
    arrivals: dict[str, float] = {}
    with InputQueue(bootstrap, kafka.input_topic) as inputs:
        sender = threading.Thread(target=send, args=(inputs, uris, features, rate, sent))
        sender.start()
        errors = read_results(consumer, arrivals, requests, timeout=600)
        sender.join()
    consumer.close()
    done = [uri for uri in uris if uri in arrivals]
    latencies = np.array([(arrivals[uri] - sent[uri]) * 1000 for uri in done])
    seconds = max(arrivals.values()) - min(sent.values()) if done else float("nan")
    return Figures(len(done), seconds, latencies, errors)


def write_config(folder: Path, model: Path, bootstrap: str, args: argparse.Namespace) -> Path:
    run_id = uuid.uuid4().hex[:8]
    path = folder / "bench-config.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"path": str(model)},
        "kafka": {"bootstrap_servers": bootstrap, "input_topic": f"bench-in-{run_id}",
                  "result_topic": f"bench-out-{run_id}", "group_id": f"bench-{run_id}"},
        "batching": {"batch_size": args.batch_size, "max_delay_ms": args.max_delay_ms},
        "flink": {"rest_port": free_port(), "parallelism": args.parallelism},
        "device": args.device,
    }))
    return path


def report(args: argparse.Namespace, load: Figures, raw: float, provider: str) -> None:
    p50, p95, p99 = np.percentile(load.latencies_ms, [50, 95, 99]) if load.requests else (float("nan"),) * 3
    print(f"model: sample classifier {FEATURES}->{args.hidden}->10, batch_size {args.batch_size}, "
          f"max_delay_ms {args.max_delay_ms}, parallelism {args.parallelism}, device {provider}")
    print(f"end to end : {load.requests}/{args.requests} results, {load.errors} errors, "
          f"{load.throughput:,.0f} req/s, latency p50 {p50:.1f} ms, p95 {p95:.1f} ms, p99 {p99:.1f} ms")
    print(f"raw onnxruntime: {raw:,.0f} req/s at batch {args.batch_size}")
    print(f"ratio end-to-end / raw onnxruntime: {load.throughput / raw:.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cluster-serving bench", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--rate", type=float, default=0.0, help="requests per second; 0 = as fast as possible")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-delay-ms", type=int, default=10)
    parser.add_argument("--parallelism", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256, help="hidden width of the sample model")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--bootstrap", help="a running Kafka to use instead of a local broker")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="cs-bench-") as folder:
        model = build_sample_model(Path(folder) / "model.onnx", hidden=args.hidden)
        broker = None if args.bootstrap else LocalBroker(port=free_port(), log_path=Path(folder) / "broker.log")
        if broker:
            broker.start()
        bootstrap = args.bootstrap or broker.bootstrap_servers
        config_path = write_config(Path(folder), model, bootstrap, args)
        job = EmbeddedJob(config_path, load_config(config_path).flink.rest_port, Path(folder) / "job.log")
        try:
            job.start()
            run_load(bootstrap, config_path, "warmup", args.warmup, rate=0.0)
            load = run_load(bootstrap, config_path, "bench", args.requests, args.rate)
        finally:
            job.stop()
            if broker:
                broker.stop()
        # The same provider choice as the job's, so the ratio compares like with like.
        session = open_session(model, args.device)
        report(args, load, raw_onnxruntime(session, args.batch_size, args.requests), session.get_providers()[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
