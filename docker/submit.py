"""The `submit` service of docker-compose.yml: puts the serving job on the compose file's Flink cluster.

    python docker/submit.py --config docker/config.yaml

Writes the sample model into the shared volume when it holds no model, waits until a TaskManager
has registered (the job would otherwise wait for slots with no sign of why), and runs
`flink run --detached -py cluster_serving/job/main.py`, unless a job named cluster-serving already runs there: a
second `docker compose up` must not start a second copy. The job's own start-up checks (model, jars,
broker reachable, topics) run inside `flink run`, and its exit code is this script's.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from cluster_serving.config import JOB_NAME, ServingConfig, load_config
from cluster_serving.net.flink_rest import TERMINAL_STATES, FlinkRest, FlinkRestError
from cluster_serving.ops.sample_model import build_sample_model

JOB_SCRIPT = Path(importlib.util.find_spec("cluster_serving.job.main").origin)
DEFAULT_CONFIG = Path(__file__).resolve().with_name("config.yaml")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="docker/submit.py", description=__doc__.splitlines()[0])
    parser.add_argument("--config", "-c", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for a TaskManager")
    return parser.parse_args(argv)


def wait_for_taskmanager(rest: FlinkRest, timeout_s: float) -> None:
    """Returns once the cluster has a TaskManager; the REST API may not answer yet at first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if rest.taskmanagers() >= 1:
                return
        except FlinkRestError:
            pass
        time.sleep(2)
    raise SystemExit(f"error: no TaskManager registered at {rest.url} within {timeout_s:.0f} s")


def serving_job_running(rest: FlinkRest) -> bool:
    """True when a cluster-serving job is on the cluster in any state but a final one."""
    return any(job.get("name") == JOB_NAME and job.get("state") not in TERMINAL_STATES for job in rest.jobs())


def ensure_model(config: ServingConfig) -> None:
    """The sample model of `cluster-serving init`, unless a model is already in the volume."""
    if not config.model.path.exists():
        build_sample_model(config.model.path)
        print(f"wrote the sample model {config.model.path}")


def flink_run_command(config_path: Path, rest_url: str) -> list[str]:
    """The README's `flink run` line, aimed at the JobManager that http.flink_rest_url names."""
    python = sys.executable
    return [
        "flink", "run", "-m", urlsplit(rest_url).netloc, "--detached",
        "-py", str(JOB_SCRIPT), "-pyexec", python, "-pyclientexec", python,
        "--", "--config", str(config_path),
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config_path = args.config.resolve()
    config = load_config(config_path)
    rest_url = config.http.flink_rest_url
    ensure_model(config)
    rest = FlinkRest(rest_url)
    wait_for_taskmanager(rest, args.timeout)
    if serving_job_running(rest):
        print(f"a {JOB_NAME!r} job already runs on {rest_url}: not submitting another")
        return 0
    command = flink_run_command(config_path, rest_url)
    print("+ " + " ".join(command), flush=True)
    return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main())
