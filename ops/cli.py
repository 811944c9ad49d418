"""`cluster-serving`: set up, run and try the serving job.

    cluster-serving init [DIR]                 starter config.yaml + sample model.onnx in DIR
    cluster-serving broker [--port 9092]       the local Apache Kafka broker (data in run/kafka)
    cluster-serving start [-c CONFIG] [--local-broker] [--no-http]
                                               the job on an embedded Flink MiniCluster + HTTP bridge
    cluster-serving status [-c CONFIG]         the job's state, input lag, throughput, web UI address
    cluster-serving stop [-c CONFIG]           stops what `start` started (final savepoint first)
    cluster-serving http [-c CONFIG]           the HTTP bridge alone
    cluster-serving demo                       broker + job + sample requests, printed results
    cluster-serving bench                      end-to-end benchmark against raw ONNX Runtime
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from ops.operations import StartRecord, status_lines, stop_started
from ops.processes import ChildProcess, EmbeddedJob, HttpBridge, LocalBroker, supervise
from client.queues import InputQueue, OutputQueue
from conf import DEFAULT_CONFIG_PATH, ConfigError, ServingConfig, load_config
from ops.sample_model import FEATURES, build_sample_model
from connectors.admin import broker_reachable


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
    return broker_reachable(f"{host}:{port}", timeout_s=0.5)


def start_local_broker(config: ServingConfig, fresh: bool = False) -> LocalBroker | None:
    """Starts the local Kafka broker on the configured port, its data next to the config file
    (`kafka/`), unless a broker already listens there."""
    host, port = broker_address(config)
    if port_in_use(host, port):
        print(f"using the Kafka broker already listening on {host}:{port}")
        return None
    broker = LocalBroker(config.folder / "kafka", port=port, log_path=config.folder / "kafka.log", fresh=fresh)
    broker.start()
    print(f"local Kafka broker on {broker.bootstrap_servers} (ready in {broker.ready_seconds:.1f} s; data: {broker.data})")
    return broker


def cmd_init(args: argparse.Namespace) -> int:
    config_path = init_folder(Path(args.folder))
    print(f"wrote {config_path} and {load_config(config_path).model.path}")
    print(f"next: cluster-serving start -c {config_path} --local-broker")
    return 0


def cmd_broker(args: argparse.Namespace) -> int:
    from connectors.local_broker import main as broker_main

    argv = ["--port", str(args.port), "--data", args.data, *(["--fresh"] if args.fresh else [])]
    argv += [item for topic in args.topic for item in ("--topic", topic)]
    return broker_main(argv)


def cmd_start(args: argparse.Namespace) -> int:
    """The job and the bridge as two child processes, their output on this terminal; when one
    ends, or on Ctrl-C / SIGTERM, both are stopped (the job with a final savepoint)."""
    config = load_config(args.config)
    if StartRecord.read(config):
        raise ConfigError(f"already started for this config (see cluster-serving status -c {args.config or ''})")
    # The children run in sessions of their own, which a closed terminal does not hang up: they
    # stop through this process.
    stop_on(signal.SIGHUP)
    broker = start_local_broker(config) if args.local_broker else None
    job = EmbeddedJob(args.config, config.flink.rest_port, fresh=args.fresh, inherit_output=True)
    children: list[ChildProcess] = [job]
    if not args.no_http:
        children.append(HttpBridge(args.config, inherit_output=True))

    def started() -> None:
        StartRecord(pid=os.getpid(), started_at=time.time(), flink_log_dir=str(config.flink_log_dir)).write(config)
        print(f"started job{'' if args.no_http else ' and HTTP bridge'} (pid {os.getpid()}); "
              f"cluster-serving status / stop{' -c ' + args.config if args.config else ''}", flush=True)

    try:
        return supervise(children, started)
    finally:
        if broker:
            broker.stop()
        StartRecord.path_for(config).unlink(missing_ok=True)


def cmd_status(args: argparse.Namespace) -> int:
    lines, running = status_lines(load_config(args.config))
    print("\n".join(lines))
    return 0 if running else 3  # 3: "not running", as service managers' status commands say


def cmd_stop(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    record = StartRecord.read(config)
    if record is None:
        print("nothing to stop: no running `cluster-serving start` for this config")
        return 0
    print(f"stopping pid {record.pid} (job: final savepoint, then stop; bridge) ...")
    if not stop_started(record, args.timeout):
        print(f"error: pid {record.pid} still runs after {args.timeout:g} s", file=sys.stderr)
        return 1
    print("stopped")
    return 0


def cmd_http(args: argparse.Namespace) -> int:
    from bridge.server import serve

    return serve(args.config)


def cmd_demo(args: argparse.Namespace) -> int:
    config_path = init_folder(Path(args.folder))
    config = load_config(config_path)
    # The demo starts from nothing each time: a fresh broker folder, so no retained position applies.
    broker = start_local_broker(config, fresh=True)
    folder = Path(args.folder)
    job = EmbeddedJob(config_path, config.flink.rest_port, log_path=folder / "job.log", fresh=True)
    bridge = HttpBridge(config_path, log_path=folder / "http.log")
    try:
        print("starting the serving job on an embedded Flink MiniCluster ...")
        job.start()
        print(f"job {job.job_id} running; Flink web UI: {job.web_ui}; job log: {job.log_path}")
        bridge.start()
        print(f"HTTP bridge: {bridge.url} (POST /predict, GET /metrics, /v1 and /v2 routes); log: {bridge.log_path}")
        show_sample_predictions(config, args.requests)
        show_http_prediction(bridge.url)
        if args.no_wait:
            return 0
        print("serving; press Ctrl-C to stop")
        while job.running and bridge.running:
            time.sleep(1)
        stopped = job if not job.running else bridge
        print(f"{stopped.module} stopped on its own; its log:\n" + stopped.log_tail())
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        print("stopping ...")
        bridge.stop()
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


def show_http_prediction(url: str) -> None:
    """One request through the HTTP bridge, and the curl line that does the same."""
    features = np.round(np.random.default_rng().normal(size=FEATURES), 3).tolist()
    body = json.dumps({"instances": [{"features": features}]})
    request = urllib.request.Request(f"{url}/predict", data=body.encode(), method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        probabilities = json.load(response)["predictions"][0]
    top = int(np.argmax(probabilities))
    print(f"POST {url}/predict: class {top} (p={probabilities[top]:.3f})")
    print(f"try: curl -d '{body}' {url}/predict")


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="cluster-serving", description=__doc__.splitlines()[0])
    commands = root.add_subparsers(dest="command", required=True)

    init = commands.add_parser("init", help="write a starter config.yaml and sample model")
    init.add_argument("folder", nargs="?", default=".")
    init.set_defaults(run=cmd_init)

    broker = commands.add_parser("broker", help="run the local Apache Kafka broker (KRaft, 127.0.0.1)")
    broker.add_argument("--port", type=int, default=9092, help="port to listen on (default 9092)")
    broker.add_argument("--data", default="run/kafka", help="data folder, kept across restarts (default run/kafka)")
    broker.add_argument("--fresh", action="store_true", help="wipe the data folder first")
    broker.add_argument("--topic", action="append", default=[], metavar="NAME:PARTITIONS")
    broker.set_defaults(run=cmd_broker)

    start = commands.add_parser("start", help="run the job on an embedded Flink MiniCluster")
    start.add_argument("--config", "-c", help="config file (default: conf/config.yaml)")
    start.add_argument("--local-broker", action="store_true", help="also start the local Kafka broker (data in kafka/ next to the config)")
    start.add_argument("--no-http", action="store_true", help="do not start the HTTP bridge")
    start.add_argument("--fresh", action="store_true", help="ignore retained checkpoints and savepoints")
    start.set_defaults(run=cmd_start)

    status = commands.add_parser("status", help="the job's state, input lag, throughput, web UI address")
    status.add_argument("--config", "-c", help="config file (default: conf/config.yaml)")
    status.set_defaults(run=cmd_status)

    stop = commands.add_parser("stop", help="stop what `start` started, with a final savepoint")
    stop.add_argument("--config", "-c", help="config file (default: conf/config.yaml)")
    stop.add_argument("--timeout", type=float, default=60.0, help="seconds to wait (default 60)")
    stop.set_defaults(run=cmd_stop)

    http = commands.add_parser("http", help="run the HTTP bridge alone")
    http.add_argument("--config", "-c", help="config file (default: conf/config.yaml)")
    http.set_defaults(run=cmd_http)

    demo = commands.add_parser("demo", help="broker + job + sample requests with printed predictions")
    demo.add_argument("--folder", default="run/demo", help="where the demo's config and model go")
    demo.add_argument("--requests", type=int, default=8)
    demo.add_argument("--no-wait", action="store_true", help="stop after printing the predictions")
    demo.set_defaults(run=cmd_demo)

    # Listed for --help only: main() hands `bench ...` to bench.run with all its options.
    commands.add_parser("bench", help="end-to-end benchmark (cluster-serving bench --help)")
    return root


def stop_on(*signums: signal.Signals) -> None:
    """These signals (SIGTERM: a supervisor, `timeout`, `kill`) unwind like Ctrl-C, so what we
    started stops too."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    for signum in signums:
        signal.signal(signum, handler)


def run_external(module: str, argv: list[str]) -> None:
    """Replaces this process with `python -m module argv`, the way git runs `git-<name>` commands:
    the benchmark is a development tool beside the product, so the CLI names it but never imports it."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        raise ConfigError(f"{module.split('.')[0]} is not installed: it runs from a clone of the repository (./run.sh bench)")
    os.execv(sys.executable, [sys.executable, "-m", module, *argv])


def main(argv: list[str] | None = None) -> int:
    stop_on(signal.SIGTERM)
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["bench"]:
            run_external("bench.run", argv[1:])
        args = parser().parse_args(argv)
        return args.run(args)
    except (ConfigError, RuntimeError) as exc:  # RuntimeError: a child that did not start, with its log
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
