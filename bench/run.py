"""End-to-end benchmark: the serving job against raw ONNX Runtime on the same model, in one run.

    cluster-serving bench --requests 5000 --batch-size 32 --hidden 256

Four figures, all measured in this run on this machine:
1. capacity: N requests are put on the input topic before the job starts; the job then drains
   that backlog as fast as it can, timed by the result topic's end offsets (read every 20 ms, so
   the client's own decoding speed is not in the figure; the rate counts from the first reading
   past a warm-up share of the backlog, which absorbs start-up, to the last);
2. latency: requests sent through InputQueue at a steady --rate, enqueue -> result read;
3. HTTP: --http-clients concurrent clients, each sending one-instance POST /predict requests over
   a kept-alive connection to the HTTP bridge: throughput and latency as the clients see them;
4. raw ONNX Runtime: a plain session fed ready batches of --batch-size, same model and provider.
The ratios printed are capacity / raw ONNX Runtime and HTTP throughput / raw ONNX Runtime.
"""

from __future__ import annotations

import argparse
import http.client
import json
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
from kafka import KafkaConsumer, TopicPartition

from client.processes import EmbeddedJob, HttpBridge, LocalBroker, free_port, write_run_config
from client.queues import InputQueue
from conf import ServingConfig, load_config
from conf.sample_model import FEATURES, build_sample_model
from connectors.admin import ensure_topics
from connectors.codec import decode_message
from job.model import open_session


@dataclass
class Arrival:
    seconds: float
    batch_size: int | None
    error: bool


class ResultReader:
    """Reads the result topic from its start and stamps when each uri's result arrived."""

    def __init__(self, config: ServingConfig):
        kafka = config.kafka
        self.consumer = KafkaConsumer(bootstrap_servers=kafka.bootstrap_servers)
        partitions = self.consumer.partitions_for_topic(kafka.result_topic)
        self.consumer.assign([TopicPartition(kafka.result_topic, p) for p in partitions])
        self.consumer.seek_to_beginning()
        self.arrivals: dict[str, Arrival] = {}
        self.duplicates = 0

    def drain_rate(self, start: int, end: int, timeout: float) -> float:
        """Results per second while the result topic grew past `start` records up to `end`, from
        the counts actually read at both ends: the job may be far past `start` at the first
        reading (NaN when it never reached `end`)."""
        deadline = time.monotonic() + timeout
        partitions = list(self.consumer.assignment())
        first: tuple[float, int] | None = None
        while time.monotonic() < deadline:
            total, now = sum(self.consumer.end_offsets(partitions).values()), time.perf_counter()
            if first is None and total >= start:
                first = (now, total)
            if first is not None and total >= end and now > first[0]:
                return (total - first[1]) / (now - first[0])
            time.sleep(0.02)
        return float("nan")

    def read_until(self, uris: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not all(uri in self.arrivals for uri in uris) and time.monotonic() < deadline:
            for records in self.consumer.poll(timeout_ms=100).values():
                now = time.perf_counter()
                for record in records:
                    message = decode_message(record.value, 1 << 28)
                    if message.uri in self.arrivals:
                        self.duplicates += 1
                        continue
                    self.arrivals[message.uri] = Arrival(now, message.batch_size, message.error is not None)


def enqueue_all(config: ServingConfig, uris: list[str], features: np.ndarray, rate: float,
                sent: dict[str, float]) -> None:
    """Sends one request per uri, at `rate` per second or as fast as possible (rate 0)."""
    interval = 1.0 / rate if rate else 0.0
    started = time.perf_counter()
    with InputQueue(config.kafka.bootstrap_servers, config.kafka.input_topic) as inputs:
        for i, uri in enumerate(uris):
            if interval:
                time.sleep(max(0.0, started + i * interval - time.perf_counter()))
            sent[uri] = time.perf_counter()
            inputs.enqueue(uri, features=features[i % len(features)])
        inputs.flush()


def http_load(url: str, features: np.ndarray, clients: int, requests: int) -> dict[str, float | str]:
    """`clients` threads share `requests` one-instance /predict calls; every answer must be a 200."""
    host, port = url.removeprefix("http://").split(":")
    latencies: list[float] = []
    failures: list[str] = []

    def client(index: int) -> None:
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        for i in range(index, requests, clients):
            body = json.dumps({"instances": [{"features": features[i % len(features)].tolist()}]})
            started = time.perf_counter()
            connection.request("POST", "/predict", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            answer = response.read()
            latencies.append((time.perf_counter() - started) * 1000)
            if response.status != 200:
                failures.append(f"{response.status} {answer[:200]!r}")
        connection.close()

    threads = [threading.Thread(target=client, args=(index,)) for index in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    return {"http_rate": len(latencies) / elapsed, "http_latency": percentiles(latencies), "http_failures": len(failures)}


def raw_onnxruntime(session: ort.InferenceSession, batch_size: int, seconds: float = 2.0) -> float:
    """Requests per second of a plain InferenceSession fed ready batches (no Kafka, no Flink),
    run for `seconds`: a fixed number of runs of a small model lasts milliseconds and is noise."""
    batch = np.random.default_rng(1).normal(size=(batch_size, FEATURES)).astype(np.float32)
    warm_until = time.perf_counter() + seconds / 10  # first runs are slower (allocation, caches)
    while time.perf_counter() < warm_until:
        session.run(None, {"features": batch})
    runs, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        session.run(None, {"features": batch})
        runs += 1
    return runs * batch_size / elapsed


def percentiles(values: list[float]) -> str:
    p50, p95, p99 = np.percentile(values, [50, 95, 99]) if values else (float("nan"),) * 3
    return f"p50 {p50:.1f} ms, p95 {p95:.1f} ms, p99 {p99:.1f} ms"


def measure(config_path: Path, folder: Path, args: argparse.Namespace) -> dict[str, float | str]:
    config = load_config(config_path)
    ensure_topics(config.kafka)
    features = np.random.default_rng(0).normal(size=(1000, FEATURES)).astype(np.float32)
    warmup = [f"warmup-{i}" for i in range(args.warmup)]
    backlog = [f"backlog-{i}" for i in range(args.requests)]
    sent: dict[str, float] = {}
    started = time.perf_counter()
    enqueue_all(config, warmup + backlog, features, 0.0, sent)
    enqueue_rate = len(sent) / (time.perf_counter() - started)

    reader = ResultReader(config)
    job = EmbeddedJob(config_path, config.flink.rest_port, folder / "job.log")
    try:
        job.start()
        capacity = reader.drain_rate(len(warmup), len(warmup) + len(backlog), timeout=900)
        reader.read_until(warmup + backlog, timeout=300)
        paced = [f"paced-{i}" for i in range(args.latency_requests)]
        sender = threading.Thread(target=enqueue_all, args=(config, paced, features, args.rate, sent))
        sender.start()
        reader.read_until(paced, timeout=300)
        sender.join()
        with HttpBridge(config_path, folder / "bridge.log") as bridge:
            served = http_load(bridge.url, features, args.http_clients, args.http_requests)
    finally:
        job.stop()
    arrivals = reader.arrivals
    missing = [uri for uri in warmup + backlog + paced if uri not in arrivals]
    sizes = [arrivals[uri].batch_size or 0 for uri in backlog if uri in arrivals]
    return {
        "enqueue_rate": enqueue_rate,
        "capacity": capacity,
        "mean_batch": float(np.mean(sizes)) if sizes else 0.0,
        "latency": percentiles([(arrivals[u].seconds - sent[u]) * 1000 for u in paced if u in arrivals]),
        "missing": len(missing),
        "errors": sum(arrival.error for arrival in arrivals.values()),
        **served,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cluster-serving bench", description=__doc__.splitlines()[0])
    # Warm-up plus backlog stay under the local broker's ~5 MiB per partition (about 600 B each).
    parser.add_argument("--requests", type=int, default=5000, help="size of the backlog drained for capacity")
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--latency-requests", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=200.0, help="requests per second in the latency phase")
    parser.add_argument("--http-clients", type=int, default=32, help="concurrent clients in the HTTP phase")
    parser.add_argument("--http-requests", type=int, default=2000, help="one-instance requests in the HTTP phase")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-delay-ms", type=int, default=10)
    parser.add_argument("--parallelism", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256, help="hidden width of the sample model")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--bootstrap", help="a running Kafka to use instead of a local broker")
    args = parser.parse_args(argv)
    if args.requests < 1000:
        parser.error("--requests: at least 1000, or the drain is too short to time")

    with tempfile.TemporaryDirectory(prefix="cs-bench-") as name:
        folder = Path(name)
        model = build_sample_model(folder / "model.onnx", hidden=args.hidden)
        broker = None if args.bootstrap else LocalBroker(folder / "kafka", port=free_port(), log_path=folder / "broker.log")
        if broker:
            broker.start()
        try:
            config_path = write_run_config(
                folder, model, args.bootstrap or broker.bootstrap_servers,
                batching={"batch_size": args.batch_size, "max_delay_ms": args.max_delay_ms},
                flink={"parallelism": args.parallelism}, device=args.device,
            )
            figures = measure(config_path, folder, args)
        finally:
            if broker:
                broker.stop()
        # The same provider choice as the job's, so the ratio compares like with like.
        session = open_session(model, args.device)
        raw = raw_onnxruntime(session, args.batch_size)

    print(f"model: sample classifier {FEATURES}->{args.hidden}->10 on {session.get_providers()[0]}; "
          f"batch_size {args.batch_size}, max_delay_ms {args.max_delay_ms}, parallelism {args.parallelism}")
    print(f"client enqueue rate (InputQueue, one thread): {figures['enqueue_rate']:,.0f} req/s")
    print(f"capacity (backlog of {args.requests} drained): {figures['capacity']:,.0f} req/s, "
          f"mean batch {figures['mean_batch']:.1f}")
    print(f"latency at {args.rate:g} req/s ({args.latency_requests} requests): {figures['latency']}")
    print(f"HTTP /predict, {args.http_clients} clients x one instance ({args.http_requests} requests): "
          f"{figures['http_rate']:,.0f} req/s, {figures['http_latency']}, non-200 answers: {figures['http_failures']}")
    print(f"raw onnxruntime at batch {args.batch_size}: {raw:,.0f} req/s")
    print(f"ratio capacity / raw onnxruntime: {figures['capacity'] / raw:.4f}; "
          f"HTTP / raw onnxruntime: {figures['http_rate'] / raw:.4f}")
    print(f"missing results: {figures['missing']}, error results: {figures['errors']}")
    return 0 if figures["missing"] == 0 and figures["http_failures"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
