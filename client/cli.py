"""`cluster-serving`: set up, run and try the serving job.

    cluster-serving init [DIR]                 starter config.yaml + sample model.onnx in DIR
    cluster-serving broker [--port 9092]       the local in-memory development broker
    cluster-serving start [-c CONFIG] [--local-broker]
                                               the job on an embedded Flink MiniCluster
    cluster-serving demo                       broker + job + sample requests, printed results
    cluster-serving bench                      end-to-end benchmark against raw ONNX Runtime
"""

from __future__ import annotations

import argparse
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from client.processes import EmbeddedJob, LocalBroker
from client.queues import InputQueue, OutputQueue
from conf import DEFAULT_CONFIG_PATH, ConfigError, ServingConfig, load_config
from conf.sample_model import FEATURES, build_sample_model


def init_folder(folder: Path) -> Path:
    """Writes config.yaml (the documented defaults) and the sample model; keeps existing files."""
    folder.mkdir(parents=True, exist_ok=True)
    config_path = folder / "config.yaml"
    if not config_path.exists():
        shutil.copyfile(DEFAULT_CONFIG_PATH, config_path)
    model_path = load_config(config_path).model.path
    if not model_path.exists():
        build_sample_model(model_path)
    return config_path


def broker_address(config: ServingConfig) -> tuple[str, int]:
    """The host and port of a single local bootstrap address; anything else is not ours to start."""
    host, _, port = config.kafka.bootstrap_servers.rpartition(":")
    if "," in config.kafka.bootstrap_servers or host not in ("127.0.0.1", "localhost") or not port.isdigit():
        raise ConfigError(
            f"kafka.bootstrap_servers: a local broker needs one 127.0.0.1:PORT address, "
            f"got {config.kafka.bootstrap_servers!r}"
        )
    return "127.0.0.1", int(port)


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex((host, port)) == 0


def start_local_broker(config: ServingConfig) -> LocalBroker | None:
    """Starts the development broker on the configured port, unless one already listens there."""
    host, port = broker_address(config)
    if port_in_use(host, port):
        print(f"using the Kafka broker already listening on {host}:{port}")
        return None
    broker = LocalBroker(port=port)
    broker.start()
    print(f"local broker (in-memory, for development) on {broker.bootstrap_servers}")
    return broker


def cmd_init(args: argparse.Namespace) -> int:
    config_path = init_folder(Path(args.folder))
    print(f"wrote {config_path} and {load_config(config_path).model.path}")
    print(f"next: cluster-serving start -c {config_path} --local-broker")
    return 0


def cmd_broker(args: argparse.Namespace) -> int:
    from connectors.local_broker import main as broker_main

    argv = ["--port", str(args.port)] + [item for topic in args.topic for item in ("--topic", topic)]
    return broker_main(argv)


def cmd_start(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    broker = start_local_broker(config) if args.local_broker else None
    command = [sys.executable, "-m", "job.main"] + (["--config", args.config] if args.config else [])
    job = subprocess.Popen(command)
    try:
        return job.wait()
    except KeyboardInterrupt:
        # Ctrl-C reached the job too, but a SIGTERM sent to this process alone did not: pass it on
        # (the job only sets its stop flag, so a second signal is harmless).
        job.send_signal(signal.SIGINT)
        return job.wait()
    finally:
        if broker:
            broker.stop()


def cmd_demo(args: argparse.Namespace) -> int:
    config_path = init_folder(Path(args.folder))
    config = load_config(config_path)
    broker = start_local_broker(config)
    job = EmbeddedJob(config_path, config.flink.rest_port, log_path=Path(args.folder) / "job.log")
    try:
        print("starting the serving job on an embedded Flink MiniCluster ...")
        job.start()
        print(f"job {job.job_id} running; Flink web UI: {job.web_ui}; job log: {job.log_path}")
        show_sample_predictions(config, args.requests)
        if args.no_wait:
            return 0
        print("serving; press Ctrl-C to stop")
        while job.running:
            time.sleep(1)
        print("the job stopped on its own; its log:\n" + job.log_tail())
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        print("stopping ...")
        job.stop()
        if broker:
            broker.stop()


def show_sample_predictions(config: ServingConfig, count: int) -> None:
    """Enqueues `count` random feature vectors through the client library and prints the answers."""
    kafka = config.kafka
    rng = np.random.default_rng()
    with InputQueue(kafka.bootstrap_servers, kafka.input_topic) as inputs, OutputQueue(
        kafka.bootstrap_servers, kafka.result_topic, group_id=f"demo-{time.time_ns()}"
    ) as outputs:
        uris = [f"demo-{i}" for i in range(count)]
        for uri in uris:
            inputs.enqueue(uri, features=rng.normal(size=FEATURES).astype(np.float32))
        inputs.flush()
        print(f"enqueued {count} requests to {kafka.input_topic}")
        for uri in uris:
            result = outputs.query(uri, timeout=30)
            if result is None:
                print(f"{uri}: no result within 30 s")
            elif "error" in result:
                print(f"{uri}: error: {result['error']}")
            else:
                probabilities = next(iter(result.values()))
                top = int(np.argmax(probabilities))
                print(f"{uri}: class {top} (p={probabilities[top]:.3f})")


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="cluster-serving", description=__doc__.splitlines()[0])
    commands = root.add_subparsers(dest="command", required=True)

    init = commands.add_parser("init", help="write a starter config.yaml and sample model")
    init.add_argument("folder", nargs="?", default=".")
    init.set_defaults(run=cmd_init)

    broker = commands.add_parser("broker", help="run the local in-memory development broker")
    broker.add_argument("--port", type=int, default=9092)
    broker.add_argument("--topic", action="append", default=[], metavar="NAME:PARTITIONS")
    broker.set_defaults(run=cmd_broker)

    start = commands.add_parser("start", help="run the job on an embedded Flink MiniCluster")
    start.add_argument("--config", "-c", help="config file (default: conf/config.yaml)")
    start.add_argument("--local-broker", action="store_true", help="also start the development broker")
    start.set_defaults(run=cmd_start)

    demo = commands.add_parser("demo", help="broker + job + sample requests with printed predictions")
    demo.add_argument("--folder", default="run/demo", help="where the demo's config and model go")
    demo.add_argument("--requests", type=int, default=8)
    demo.add_argument("--no-wait", action="store_true", help="stop after printing the predictions")
    demo.set_defaults(run=cmd_demo)

    # Listed for --help only: main() hands `bench ...` to bench.run with all its options.
    commands.add_parser("bench", help="end-to-end benchmark (cluster-serving bench --help)")
    return root


def stop_on_sigterm() -> None:
    """SIGTERM (a supervisor, `timeout`, `kill`) unwinds like Ctrl-C, so what we started stops too."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    stop_on_sigterm()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from bench.run import main as bench_main

        return bench_main(argv[1:])
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except (ConfigError, RuntimeError) as exc:  # RuntimeError: a child that did not start, with its log
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
