"""`python -m bench.peers`: the job beside Seldon MLServer's own Kafka server, on MLServer's Kafka
format, one run: the same MLP (the bench's), the same local broker, the same load (bench/peer_drain.py:
COUNT JSON InferenceRequests with header mlserver-model, written by librdkafka as fast as it goes
while the server runs, every answer read), requests/s from the first write to the last answer.

MLServer 1.7.1 serves it with an ONNX Runtime runtime as a user would write one
(bench/mlserver_runtime.py), its adaptive batching on (`max_batch_size`, `max_batch_time`), in
`.venv-peers` (made by `./run.sh test`; this adds onnxruntime and confluent-kafka to it). A
request it never answers (its Kafka server only logs a failure) is counted once no answer has
come for 30 s. The job gets a warm-up load of up to 2,000 requests first.

    python -m bench.peers --requests 20000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from confluent_kafka.admin import AdminClient, NewTopic

from cluster_serving.config import load_config
from cluster_serving.ops.children import EmbeddedJob, LocalBroker
from cluster_serving.ops.processes import free_port, write_run_config
from cluster_serving.ops.sample_model import build_sample_model

ROOT = Path(__file__).resolve().parent.parent
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
MODEL = "mlp"


def ensure_peer_packages() -> None:
    """onnxruntime and confluent-kafka in .venv-peers, for MLServer's runtime and the load."""
    if not PEERS_PYTHON.exists():
        sys.exit("error: no .venv-peers: run ./run.sh test once (it makes it)")
    if subprocess.run([str(PEERS_PYTHON), "-c", "import onnxruntime, confluent_kafka"], capture_output=True).returncode:
        print("[peers] installing onnxruntime and confluent-kafka into .venv-peers ...", file=sys.stderr)
        subprocess.run([str(PEERS_PYTHON), "-m", "pip", "install", "-q", "onnxruntime", "confluent-kafka"], check=True)


def drain(bootstrap: str, input_topic: str, output_topic: str, model: str, count: int) -> dict:
    run = subprocess.run([str(PEERS_PYTHON), str(ROOT / "bench" / "peer_drain.py"), bootstrap, input_topic, output_topic,
                          model, str(count)], capture_output=True, text=True, timeout=900)
    if run.returncode:
        sys.exit(f"error: the load failed: {run.stderr[-2000:]}")
    return json.loads(run.stdout.splitlines()[-1])


def mlserver(folder: Path, model_path: Path, bootstrap: str, args: argparse.Namespace) -> dict:
    """Starts MLServer with its Kafka server on new topics, drains the load through it, stops it."""
    serving = folder / "mlserver"
    (serving / MODEL).mkdir(parents=True)
    topics = ("mlserver-input", "mlserver-output")
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for created in admin.create_topics([NewTopic(topic, 1, 1) for topic in topics]).values():
        created.result(30)
    http_port = free_port()
    (serving / "settings.json").write_text(json.dumps({
        "kafka_enabled": True, "kafka_servers": bootstrap, "kafka_topic_input": topics[0], "kafka_topic_output": topics[1],
        "http_port": http_port, "grpc_port": free_port(), "metrics_port": free_port(), "host": "127.0.0.1",
        # Its inference workers (separate processes) fail to start here with this uvloop ("no
        # current event loop"): the model runs in the server's process, as with one core's worth.
        "parallel_workers": 0}))
    (serving / MODEL / "model-settings.json").write_text(json.dumps({
        "name": MODEL, "implementation": "bench.mlserver_runtime.OnnxRuntime", "parameters": {"uri": str(model_path)},
        "max_batch_size": args.max_batch_size, "max_batch_time": args.max_batch_time_ms / 1000}))
    log = open(folder / "mlserver.log", "w")
    server = subprocess.Popen([str(PEERS_PYTHON.parent / "mlserver"), "start", str(serving)], cwd=ROOT, stdout=log,
                              stderr=subprocess.STDOUT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    try:
        wait_ready(f"http://127.0.0.1:{http_port}/v2/models/{MODEL}/ready", server)
        time.sleep(2)  # its Kafka consumer joins no group: it reads what comes after it has started
        return drain(bootstrap, *topics, MODEL, args.requests)
    finally:
        server.terminate()
        server.wait(30)
        log.close()


def wait_ready(url: str, server: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit("error: MLServer stopped while starting; see mlserver.log")
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    sys.exit("error: MLServer was not ready in time")


def ours(folder: Path, model_path: Path, bootstrap: str, args: argparse.Namespace) -> dict:
    """Starts the job on new topics, drains the same load through it, stops it."""
    (folder / "job").mkdir()
    path = write_run_config(folder / "job", model_path, bootstrap, model={"path": str(model_path), "name": MODEL})
    config = load_config(path)
    job = EmbeddedJob(path, config.flink.rest_port, folder / "job.log")
    job.start()
    try:
        drain(bootstrap, config.kafka.input_topic, config.kafka.result_topic, MODEL, min(args.requests, 2000))  # warm-up
        return drain(bootstrap, config.kafka.input_topic, config.kafka.result_topic, MODEL, args.requests)
    finally:
        job.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--max-batch-size", type=int, default=32, help="MLServer's adaptive batching (the job's batch_size is 32)")
    parser.add_argument("--max-batch-time-ms", type=float, default=5.0)
    args = parser.parse_args(argv)
    ensure_peer_packages()
    folder = Path(tempfile.mkdtemp(prefix="bench-peers-"))  # kept: the servers' logs are there
    print(f"[peers] logs in {folder}", file=sys.stderr)
    model_path = build_sample_model(folder / "mlp.onnx")
    broker = LocalBroker(folder / "kafka", port=free_port(), log_path=folder / "broker.log")
    broker.start()
    try:
        figures = {"MLServer 1.7.1 Kafka server": mlserver(folder, model_path, broker.bootstrap_servers, args),
                   "cluster-serving job": ours(folder, model_path, broker.bootstrap_servers, args)}
    finally:
        broker.stop()
    print(f"{args.requests:,} MLServer-format requests (JSON InferenceRequest, header mlserver-model), MLP 16->10:")
    for name, figure in figures.items():
        print(f"  {name:<30} {figure['rate']:>10,.0f} answers/s   answered {figure['answered']:,}, errors"
              f" {figure['errors']}, never answered {figure['lost']:,}")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
