"""Backpressure: requests arrive `--factor` times faster than the model can serve, for `--duration`
seconds; nothing may be lost, the job's memory must stay flat while the backlog waits in Kafka,
and latency must come back once the backlog is drained.

    python -m bench.backpressure --duration 60 --factor 5       (the README's figures)

The model is a real ONNX graph built here, slow on purpose: features [batch, 16] -> `--layers`
x (MatMul 1024x1024 -> Tanh) -> scores [batch, 4], one shared weight (a 4 MB file). Its capacity is
measured with raw ONNX Runtime first, in this run, and the input rate is `factor` times that.
Printed: capacity, input rate, sent/answered/lost/duplicates, time to drain, the job's resident
memory (all processes of its group) before, at peak and after, the peak input lag, and latency
of a few paced requests before and after the burst.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper, save

from bench.report import percentiles
from bench.run import ResultReader, enqueue_all, raw_onnxruntime
from cluster_serving.config import ServingConfig, load_config
from cluster_serving.kafka.admin import LagProbe, ensure_topics
from cluster_serving.ops.children import EmbeddedJob, LocalBroker
from cluster_serving.ops.processes import free_port, group_rss_mb, write_run_config
from cluster_serving.ops.sample_model import FEATURES, IR_VERSION, OPSET

WIDTH = 1024
PROBES = 20
PROBE_RATE = 5.0


def slow_model(path: Path, layers: int) -> Path:
    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array((rng.normal(size=(FEATURES, WIDTH)) / 4).astype(np.float32), "w_in"),
        numpy_helper.from_array((rng.normal(size=(WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32), "w"),
        numpy_helper.from_array((rng.normal(size=(WIDTH, 4)) / np.sqrt(WIDTH)).astype(np.float32), "w_out"),
    ]
    nodes = [helper.make_node("MatMul", ["features", "w_in"], ["h0"])]
    for i in range(layers):
        nodes.append(helper.make_node("MatMul", [f"h{i}", "w"], [f"m{i}"]))
        nodes.append(helper.make_node("Tanh", [f"m{i}"], [f"h{i + 1}"]))
    nodes.append(helper.make_node("MatMul", [f"h{layers}", "w_out"], ["scores"]))
    graph = helper.make_graph(
        nodes, "slow",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", FEATURES])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", 4])],
        initializer=weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    save(model, str(path))
    return path


def raw_capacity(model: Path, batch_size: int) -> float:
    """Requests per second of a plain CPU InferenceSession fed full batches (the job runs on CPU)."""
    return raw_onnxruntime(ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]), batch_size)


class Sampler(threading.Thread):
    """Samples the job's memory and the input lag every half second until stopped."""

    def __init__(self, pgid: int, config: ServingConfig):
        super().__init__(daemon=True)
        self.pgid, self.rss, self.lags = pgid, [], []
        self.probe = LagProbe(config.kafka.bootstrap_servers, config.kafka.input_topic, config.kafka.group_id)
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            self.rss.append(group_rss_mb(self.pgid))
            self.lags.append(self.probe.lag())
        self.probe.close()


def latency_probe(config: ServingConfig, reader: ResultReader, prefix: str, sent: dict[str, float]) -> str:
    """Enqueue -> result latency of a few paced requests; the reader stamps results while they are sent."""
    uris = [f"{prefix}-{i}" for i in range(PROBES)]
    probe = np.ones((1, FEATURES), np.float32)
    sender = threading.Thread(target=enqueue_all, args=(config, uris, "features", probe, PROBE_RATE, sent))
    sender.start()
    reader.read_until(uris, timeout=300)
    sender.join()
    return percentiles([(reader.arrivals[uri].seconds - sent[uri]) * 1000 for uri in uris if uri in reader.arrivals])


def run(config: ServingConfig, job: EmbeddedJob, duration: float, factor: float, capacity: float) -> dict:
    """The burst against a running job; returns the figures."""
    features = np.random.default_rng(0).normal(size=(256, FEATURES)).astype(np.float32)
    reader, sent = ResultReader(config.kafka.bootstrap_servers, config.kafka.result_topic), {}
    before = latency_probe(config, reader, "before", sent)
    sampler = Sampler(job.process.pid, config)
    sampler.start()
    rate = factor * capacity
    burst = [f"burst-{i}" for i in range(int(rate * duration))]
    started = time.perf_counter()
    enqueue_all(config, burst, "features", features, rate, sent)
    sending = time.perf_counter() - started
    reader.read_until(burst, timeout=duration * factor * 4 + 120)
    drained = time.perf_counter() - started
    after = latency_probe(config, reader, "after", sent)
    sampler.done.set()
    sampler.join()
    answered = [uri for uri in burst if uri in reader.arrivals]
    return {
        "raw capacity (req/s)": round(capacity, 1),
        "input rate (req/s)": round(len(burst) / sending, 1),
        "burst seconds": round(sending, 1),
        "sent": len(burst),
        "answered": len(answered),
        "lost": len(burst) - len(answered),
        "error results": sum(reader.arrivals[uri].error for uri in answered),
        "duplicates": reader.duplicates,
        "seconds to drain": round(drained, 1),
        "served rate (req/s)": round(len(answered) / drained, 1),
        "peak input lag": max(sampler.lags, default=0),
        "job RSS MB start/peak/end": [round(sampler.rss[0]), round(max(sampler.rss)), round(sampler.rss[-1])],
        "latency before": before,
        "latency after": after,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.backpressure", description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of over-rate input")
    parser.add_argument("--factor", type=float, default=5.0, help="input rate / the model's capacity")
    parser.add_argument("--layers", type=int, default=400, help="MatMul layers of the slow model")
    parser.add_argument("--partitions", type=int, default=8, help="partitions of the input topic")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cs-backpressure-") as name:
        folder = Path(name)
        model = slow_model(folder / "model.onnx", args.layers)
        capacity = raw_capacity(model, args.batch_size)
        with LocalBroker(folder / "kafka", port=free_port(), log_path=folder / "broker.log") as broker:
            path = write_run_config(
                folder, model, broker.bootstrap_servers, kafka={"partitions": args.partitions},
                batching={"batch_size": args.batch_size, "max_delay_ms": 10}, device="cpu",
            )
            config = load_config(path)
            ensure_topics(config.kafka)
            with EmbeddedJob(path, config.flink.rest_port, folder / "job.log") as job:
                figures = run(config, job, args.duration, args.factor, capacity)
    print(json.dumps(figures, indent=1))
    return 0 if figures["lost"] == 0 and figures["error results"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
