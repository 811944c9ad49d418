"""`cluster-serving start`, `status` and `stop` as an operator runs them: job and HTTP bridge up,
a second start refused, status shows them, stop ends both with a final savepoint and leaves
nothing behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from cluster_serving.ops.instances import RECORD_FILE, REGISTRY_ENV
from cluster_serving.ops.sample_model import FEATURES
from tests.conftest import http_call
from tests.paths import PROJECT_ROOT


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cluster_serving.ops.cli", *args], cwd=PROJECT_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def wait_until_ready(url: str, start: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and start.poll() is None:
        try:
            if http_call(f"{url}/v2/health/ready")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(1)


def test_start_status_stop(write_config, tmp_path: Path) -> None:
    path, config = write_config()
    url = f"http://127.0.0.1:{config.http.port}"
    # A registry of its own: `status` and `stop` without -c then mean this test's instance alone.
    env = {**os.environ, REGISTRY_ENV: str(tmp_path / "registry")}
    start = subprocess.Popen(
        [sys.executable, "-m", "cluster_serving.ops.cli", "start", "-c", str(path)], cwd=PROJECT_ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        wait_until_ready(url, start)
        status, body = http_call(f"{url}/predict", {"instances": [{"features": [0.25] * FEATURES}]})
        assert status == 200 and len(body["predictions"][0]) == 10, body
        again = cli(env, "start", "-c", str(path))
        assert again.returncode == 2 and again.stderr.startswith(f"error: `cluster-serving start` (pid {start.pid}"), again.stderr
        assert "already runs in" in again.stderr and again.stderr.count("\n") == 1, again.stderr
        copy = tmp_path / "copy" / path.name
        copy.parent.mkdir()
        shutil.copyfile(path, copy)
        elsewhere = cli(env, "start", "-c", str(copy))
        assert elsewhere.returncode == 2 and f"already uses port {config.flink.rest_port}" in elsewhere.stderr, elsewhere.stderr
        assert not (copy.parent / "checkpoints").exists() and not (copy.parent / "log").exists()
        shown = cli(env, "status")  # no -c: the only instance running
        assert shown.returncode == 0, shown.stdout + shown.stderr
        for expected in (f"instance: `cluster-serving start` (pid {start.pid}, config {path})", "job: RUNNING",
                         f"Flink web UI: http://127.0.0.1:{config.flink.rest_port}", "input lag: ", "requests/s in: ",
                         "results/s out: ", f"HTTP bridge: ready on {url}", "Flink log: "):
            assert expected in shown.stdout, shown.stdout
        stopped = cli(env, "stop")
        assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stdout + stopped.stderr
        output, _ = start.communicate(timeout=60)
    finally:
        if start.poll() is None:
            start.kill()
    assert start.returncode == 0, output
    assert "http bridge listening on" in output and "http bridge stopped" in output, output
    assert "final savepoint" in output and "cancelling" not in output, output
    assert not (path.parent / RECORD_FILE).exists() and list((tmp_path / "registry").iterdir()) == []
    after = cli(env, "status", "-c", str(path))
    assert after.returncode == 3 and "instance: none runs" in after.stdout and "job: " in after.stdout, after.stdout
