"""`cluster-serving start` as an operator runs it: job and HTTP bridge up, one SIGTERM stops both."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from client.processes import PROJECT_ROOT
from conf.sample_model import FEATURES
from tests.conftest import http_call


def test_start_serves_http_and_stops_both_children(write_config) -> None:
    path, config = write_config()
    url = f"http://127.0.0.1:{config.http.port}"
    start = subprocess.Popen(
        [sys.executable, "-m", "client.cli", "start", "-c", str(path)], cwd=PROJECT_ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and start.poll() is None:
            try:
                if http_call(f"{url}/v2/health/ready")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(1)
        status, body = http_call(f"{url}/predict", {"instances": [{"features": [0.25] * FEATURES}]})
        assert status == 200 and len(body["predictions"][0]) == 10, body
    finally:
        start.send_signal(signal.SIGTERM)
        output, _ = start.communicate(timeout=60)
    assert start.returncode == 0, output
    assert "http bridge listening on" in output and "http bridge stopped" in output, output
    assert "stopping job" in output, output
