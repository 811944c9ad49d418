"""`cluster-serving`: set up, run and try the serving job.

    cluster-serving init [DIR]                 starter config.yaml + sample model.onnx in DIR
    cluster-serving broker [--port 9092] [--secure]  the local Apache Kafka broker (data in run/kafka)
    cluster-serving start [-c CONFIG] [--local-broker] [--no-http]
                                               the job on an embedded Flink MiniCluster + HTTP bridge
    cluster-serving status [-c CONFIG]         the job's state, input lag, throughput, web UI address
    cluster-serving stop [-c CONFIG]           stops what `start` or `demo` started (final savepoint first)
    cluster-serving restart [-c CONFIG]        the job of `start` again from a final savepoint, as the config
                                               now says (a new flink.parallelism: a rescale), in the same JVM
                                               (new flink.jvm_options: a new one); the bridge serves on
    cluster-serving http [-c CONFIG]           the HTTP bridge alone
    cluster-serving cluster up|submit|stop|status|down
                                               a local standalone Flink cluster, and the job on it
    cluster-serving replay --from T --into TOPIC [--model M --version V] [--compare]
                                               a range of the request log served again into a side topic
    cluster-serving demo                       broker + job + sample requests, printed results
    cluster-serving bench                      end-to-end benchmark against raw ONNX Runtime
    cluster-serving bench stage                the serving stage alone (no Kafka, no Flink) against raw ONNX Runtime

A mistake (a config value, the model, a port in use, another instance in the way, no broker, no
Java) is one `error: ...` line on stderr and exit code 2, found before anything starts;
`cluster-serving --verbose ...` adds the traceback.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import shutil
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from cluster_serving.config import DEFAULT_CONFIG_PATH, JOB_NAME, RESTART_SIGNAL, ConfigError, ServingConfig, load_config
from cluster_serving.config.command_line import OneLineParser
from cluster_serving.net.ports import port_taken
from cluster_serving.ops.children import ChildFailed, ChildProcess, EmbeddedJob, HttpBridge, supervise
from cluster_serving.ops.demo import run_demo
from cluster_serving.ops.instances import Instance, claim, commands_for, find_instance, stop_instance
from cluster_serving.ops.local_broker import BrokerError
from cluster_serving.ops.operations import broker_address, check_start, restart_job, start_local_broker, status_lines
from cluster_serving.ops.sample_model import build_sample_model

if TYPE_CHECKING:
    from cluster_serving.ops.cluster import StandaloneCluster

# What a user can get wrong, each said in one line (OSError: a folder or file that cannot be written).
USER_ERRORS = (ConfigError, BrokerError, RuntimeError, OSError)


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


def cmd_init(args: argparse.Namespace) -> int:
    folder = Path(args.folder)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{folder} is a file; init writes config.yaml and model.onnx into a folder: name one")
    config_path = init_folder(folder)
    print(f"wrote {config_path} and {load_config(config_path).model.path}")
    print(f"next: cluster-serving start -c {config_path} --local-broker")
    return 0


def cmd_broker(args: argparse.Namespace) -> int:
    from cluster_serving.ops.local_broker import main as broker_main

    argv = ["--port", str(args.port), "--data", args.data, *(["--fresh"] if args.fresh else [])]
    argv += [item for topic in args.topic for item in ("--topic", topic)]
    argv += ["--secure"] if args.secure else []
    argv += ["--request-topic", args.request_topic] if args.request_topic else []
    return broker_main(argv)


def cmd_cluster(args: argparse.Namespace) -> int:
    """A local standalone Flink cluster from the installed PyFlink, and the job submitted to it
    with `flink run -py`, as one submits to any Flink cluster."""
    from cluster_serving.ops.cluster import JOB_SCRIPT, StandaloneCluster

    folder = Path(args.dir)
    if args.action == "up":
        if port_taken("127.0.0.1", args.rest_port):
            raise ConfigError(f"--rest-port: 127.0.0.1:{args.rest_port} is in use; stop what listens there or pick another port")
        cluster = StandaloneCluster(args.rest_port, folder, args.task_slots, taskmanagers=args.taskmanagers)
        cluster.start()
        print(f"Flink cluster up: {args.taskmanagers} TaskManager(s) x {args.task_slots} slots; web UI {cluster.web_ui}; logs in {cluster.log_dir}")
        print(f"next: cluster-serving cluster submit -c CONFIG --dir {folder}  (runs flink run -py {JOB_SCRIPT})")
        return 0
    cluster = StandaloneCluster.of_folder(folder)
    config_path = Path(args.config).resolve() if args.config else DEFAULT_CONFIG_PATH
    if args.action == "submit":
        job_id, start = cluster.submit(config_path)
        cluster.rest.wait_until_running(job_id, timeout_s=120)
        print(f"job {job_id} running on {cluster.web_ui}, {start}")
        return 0
    if args.action == "stop":
        return stop_cluster_job(cluster, load_config(config_path))
    if args.action == "down":
        cluster.stop()
        print(f"Flink cluster of {folder} stopped")
        return 0
    return cluster_status(cluster)


def stop_cluster_job(cluster: StandaloneCluster, config: ServingConfig) -> int:
    """Stops the running serving job with a final savepoint where the next `cluster submit` of the
    same config resumes from it; the cluster, its JVMs and the code they compiled, stay up."""
    job = cluster.rest.find_job(JOB_NAME)
    if not isinstance(job, dict) or job["state"] != "RUNNING":
        raise ConfigError(f"no running {JOB_NAME} job to stop on {cluster.web_ui}" + (f" ({job})" if isinstance(job, str) else ""))
    try:
        location = cluster.rest.stop_with_savepoint(job["jid"], config.flink.savepoint_dir.as_uri())
    except RuntimeError as exc:
        raise ConfigError(str(exc)) from exc
    print(f"job {job['jid']} stopped with a final savepoint {location}; `cluster submit` with this config resumes from it")
    return 0


def cluster_status(cluster: StandaloneCluster) -> int:
    """One line for the cluster, one per job; exit 3 when it does not answer."""
    try:
        overview = cluster.rest.get("/overview")
        jobs = cluster.rest.jobs()
    except OSError as exc:
        print(f"Flink cluster of {cluster.work_dir}: not answering ({exc})")
        return 3
    print(f"Flink cluster of {cluster.work_dir}: {overview['taskmanagers']} TaskManager(s), "
          f"{overview['slots-available']} of {overview['slots-total']} slots free; web UI {cluster.web_ui}")
    for job in jobs:
        print(f"  job {job['jid']} {job['name']}: {job['state']}")
    return 0


def cmd_start(args: argparse.Namespace) -> int:
    """The job and the bridge as two child processes, their output on this terminal; when one
    ends, or on Ctrl-C / SIGTERM, both are stopped (the job with a final savepoint). Another
    instance in the way, and every check of check_start, refuse before anything starts."""
    config = load_config(args.config)
    broker_port = broker_address(config)[1] if args.local_broker else None
    instance = Instance.of("start", config, http=not args.no_http, broker_port=broker_port)
    held = claim(instance)
    signal.signal(RESTART_SIGNAL, signal.SIG_IGN)  # a restart asked for before the job runs: it starts as the file says anyway
    broker = None
    try:
        check_start(config, http=not args.no_http, local_broker=args.local_broker)
        # The children run in sessions of their own, which a closed terminal does not hang up: they
        # stop through this process.
        stop_on(signal.SIGHUP)
        broker = start_local_broker(config) if args.local_broker else None
        children: list[ChildProcess] = [EmbeddedJob(args.config, config.flink.rest_port, fresh=args.fresh, inherit_output=True)]
        if not args.no_http:
            children.append(HttpBridge(args.config, inherit_output=True))

        def started() -> None:
            print(f"started job{'' if args.no_http else ' and HTTP bridge'} (pid {os.getpid()}); "
                  f"{instance.command_for('status')} / {instance.command_for('stop')}", flush=True)

        return supervise(children, started, restart_on=RESTART_SIGNAL)
    finally:
        if broker:
            broker.stop()
        held.release()


def cmd_status(args: argparse.Namespace) -> int:
    config, instance = find_instance(args.config, "status")
    lines, running = status_lines(config, instance)
    print("\n".join(lines))
    return 0 if running else 3  # 3: "not running", as service managers' status commands say


def cmd_stop(args: argparse.Namespace) -> int:
    config, instance = find_instance(args.config, "stop")
    if instance is None:
        running = commands_for("stop")
        if running:
            raise ConfigError(f"no instance runs with {config.source}; running: {running}")
        print("nothing to stop: no `cluster-serving start` or `demo` runs" + (f" with {config.source}" if args.config else ""))
        return 0
    print(f"stopping {instance.name}: the job with a final savepoint, then the bridge ...", flush=True)
    if not stop_instance(instance, args.timeout):
        print(f"error: pid {instance.pid} still runs after {args.timeout:g} s; wait longer (--timeout) "
              f"or end it: kill {instance.pid}", file=sys.stderr)
        return 1
    print("stopped")
    return 0


def cmd_restart(args: argparse.Namespace) -> int:
    """The job of a running `start` stopped with a final savepoint and started again from it, with
    the config file as it reads now (a new flink.parallelism: a rescale); the bridge serves on."""
    config, instance = find_instance(args.config, "restart")
    if instance is None:
        running = commands_for("restart")
        raise ConfigError("no `cluster-serving start` runs" + (f" with {config.source}" if args.config else "")
                          + (f"; running: {running}" if running else ""))
    if instance.command != "start":
        raise ConfigError(f"{instance.name} is a demo, whose job stops and starts with it; restart is for `cluster-serving start`")
    print(f"restarting the job of {instance.name} at parallelism {config.flink.parallelism}: "
          "a final savepoint, then the job again from it ...", flush=True)
    job = restart_job(config, instance, args.timeout)
    print(f"restarted: job {job['jid']} runs at parallelism {max(vertex['parallelism'] for vertex in job['vertices'])}")
    return 0


def cmd_http(args: argparse.Namespace) -> int:
    from cluster_serving.http.server import serve

    return serve(args.config)


def cmd_demo(args: argparse.Namespace) -> int:
    """Refused, before anything is written or started, while another demo runs in the folder or
    another instance uses its ports (the demo's fixed 9092, 8081, 10020)."""
    folder = Path(args.folder)
    config_path = init_folder(folder)  # writes only what is missing
    config = load_config(config_path)
    held = claim(Instance.of("demo", config, http=True, broker_port=broker_address(config)[1]))
    try:
        check_start(config, http=True, local_broker=True)
        return run_demo(config, config_path, folder, args.requests, args.no_wait)
    finally:
        held.release()


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help ends with its default, except where there is none to show: a flag (off
    unless given) or an option whose help says what happens without it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


CONFIG_HELP = "config file; keys it lacks take cluster_serving/config/config.yaml's defaults (default: those defaults, run state in the working folder)"
FIND_HELP = ("config of the instance (default: the default config's instance in the working folder, "
             "else the only instance running, `demo` included)")


def package_version() -> str:
    try:
        return importlib.metadata.version("cluster-serving")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def parser() -> argparse.ArgumentParser:
    # --verbose is global, and accepted after the command too (SUPPRESS: a command's own default
    # would otherwise hide one given before it); main() reads it from the raw arguments.
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS,
                         help="on an error, print its traceback too")
    options = {"formatter_class": DefaultsFormatter, "parents": [verbose]}
    root = OneLineParser(prog="cluster-serving", description=__doc__.split("\n\n")[0], **options)
    root.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    commands = root.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, summary: str, run: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=summary, description=summary, **options)
        sub.set_defaults(run=run)
        return sub

    init = command("init", "write a starter config.yaml and sample model", cmd_init)
    init.add_argument("folder", nargs="?", default=".", help="where config.yaml and model.onnx go; existing files are kept")

    broker = command("broker", "run the local Apache Kafka broker (KRaft, 127.0.0.1)", cmd_broker)
    broker.add_argument("--port", type=int, default=9092, help="port on 127.0.0.1 to listen on; 0 picks a free one")
    broker.add_argument("--data", default="run/kafka", help="data folder, kept across restarts")
    broker.add_argument("--fresh", action="store_true", help="wipe the data folder first")
    broker.add_argument("--topic", action="append", default=[], metavar="NAME:PARTITIONS",
                        help="a topic to create when missing; repeatable (default: none)")
    broker.add_argument("--secure", action="store_true",
                        help="TLS, SASL/SCRAM users and ACLs; prints the client settings for kafka.properties")
    broker.add_argument("--request-topic",
                        help="with --secure: the one topic user `requester` may write (default: kafka.input_topic's default)")

    start = command("start", "run the job on an embedded Flink MiniCluster, and the HTTP bridge", cmd_start)
    start.add_argument("--config", "-c", help=CONFIG_HELP)
    start.add_argument("--local-broker", action="store_true",
                       help="also run the local Kafka broker on kafka.bootstrap_servers' port, its data in kafka/ "
                            "next to the config (a broker already listening there is used instead)")
    start.add_argument("--no-http", action="store_true", help="do not start the HTTP bridge")
    start.add_argument("--fresh", action="store_true",
                       help="start from the group's committed offsets, not from the newest retained checkpoint or savepoint")

    status = command("status", "the job's state, input lag, throughput, web UI address", cmd_status)
    status.add_argument("--config", "-c", help=FIND_HELP)

    stop = command("stop", "stop what `start` or `demo` started, the job with a final savepoint", cmd_stop)
    stop.add_argument("--config", "-c", help=FIND_HELP)
    stop.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for it to stop")

    restart = command("restart", "restart the job of a running `start` with its config as the file now says "
                      "(a new flink.parallelism: a rescale), from a final savepoint, in the same JVM (new "
                      "flink.jvm_options: a new one); the bridge serves on", cmd_restart)
    restart.add_argument("--config", "-c", help=FIND_HELP)
    restart.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the job to run again")

    http = command("http", "run the HTTP bridge alone (for a job running elsewhere)", cmd_http)
    http.add_argument("--config", "-c", help=CONFIG_HELP)

    demo = command("demo", "broker + job + sample requests with printed predictions", cmd_demo)
    demo.add_argument("--folder", default="run/demo", help="where the demo's config, model, logs and broker data go")
    demo.add_argument("--requests", type=int, default=8, help="sample requests sent through the client library")
    demo.add_argument("--no-wait", action="store_true", help="stop after printing the predictions")

    cluster = command("cluster", "a local standalone Flink cluster: up, submit the job, stop it, status, down", cmd_cluster)
    cluster.add_argument("action", choices=["up", "submit", "stop", "status", "down"])
    cluster.add_argument("--dir", default="run/flink", help="the cluster's folder: its conf/, lib/, log/ and pid/")
    cluster.add_argument("--config", "-c", help="submit, stop: the job's config (default: cluster_serving/config/config.yaml's defaults)")
    cluster.add_argument("--taskmanagers", type=int, default=1, help="up: how many TaskManagers")
    cluster.add_argument("--task-slots", type=int, default=2, help="up: slots per TaskManager")
    cluster.add_argument("--rest-port", type=int, default=8081, help="up: the web UI and REST API's port on 127.0.0.1")

    # Listed for --help only: main() hands `replay ...` to the job's replay command, `bench ...` to
    # bench.run, `bench stage ...` to bench.stage.
    commands.add_parser("replay", help="serve a range of the request log again into a side topic (cluster-serving replay --help)")
    commands.add_parser("bench", help="end-to-end benchmark (cluster-serving bench --help); the serving stage alone: bench stage --help")
    return root


def stop_on(*signums: signal.Signals) -> None:
    """These signals (SIGTERM: a supervisor, `timeout`, `kill`, `cluster-serving stop`) unwind like
    Ctrl-C, so what we started stops too."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    for signum in signums:
        signal.signal(signum, handler)


def run_module(module: str, argv: list[str]) -> None:
    """Replaces this process with `python -m module argv`: a command whose work is a room the CLI
    does not import (the replay is a Flink job, as `start`'s is a process of its own)."""
    os.execv(sys.executable, [sys.executable, "-m", module, *argv])


def run_external(module: str, argv: list[str]) -> None:
    """Replaces this process with `python -m module argv`, the way git runs `git-<name>` commands:
    the benchmark is a development tool beside the product, so the CLI names it but never imports it."""
    folder = module.split(".")[0]
    if importlib.util.find_spec(folder) is None and not (Path.cwd() / folder / "__init__.py").is_file():
        raise ConfigError(f"{folder}/ is not in the working folder: it runs from a clone of the repository (./run.sh bench)")
    run_module(module, argv)  # -m: the working folder first on the path


def error_line(exc: BaseException) -> str:
    """The one line an error is: a child's summary rather than its log, an OS error's file and reason."""
    if isinstance(exc, ChildFailed):
        return exc.summary
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    stop_on(signal.SIGTERM)
    argv = sys.argv[1:] if argv is None else argv
    verbose = "--verbose" in argv
    command = next((i for i, arg in enumerate(argv) if not arg.startswith("-")), len(argv))
    try:
        if argv[command:command + 1] == ["replay"]:
            run_module("cluster_serving.job.replay", argv[command + 1:])
        if argv[command:command + 2] == ["bench", "stage"]:
            run_external("bench.stage", argv[command + 2:])
        if argv[command:command + 1] == ["bench"]:
            run_external("bench.run", argv[command + 1:])
        args = parser().parse_args(argv)
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if verbose:
            traceback.print_exception(exc)
        known = isinstance(exc, USER_ERRORS)
        hint = "" if known or verbose else f" ({type(exc).__name__}; cluster-serving --verbose shows where)"
        print(f"error: {error_line(exc)}{hint}", file=sys.stderr)
        return 2 if known else 1


if __name__ == "__main__":
    sys.exit(main())
