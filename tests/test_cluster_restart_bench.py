"""`python -m bench.cluster_restart` at a small size: the job on a standalone cluster, its first
start, a drain while it runs, a restart (final savepoint, submitted again) and a paced phase after
one more, every request answered; the figures themselves are the benchmark's, not asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.paths import PROJECT_ROOT


def test_the_restart_bench_restarts_the_job_on_its_cluster_and_answers_every_request(tmp_path: Path) -> None:
    out = tmp_path / "restart.json"
    run = subprocess.run(
        [sys.executable, "-m", "bench.cluster_restart", "--requests", "10000", "--running-drains", "1", "--restarts", "1",
         "--first-seconds", "3", "--rate", "1000", "--json", str(out)],
        cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["plain_loop"]["librdkafka"] > 0 and figures["first_start"] > 0
    assert len(figures["running_drains"]) == 1 and figures["running_drains"][0] > 0
    [restart] = figures["restarts"]
    assert restart["right_after_restart"] > 0 and restart["running_after"] > 0
    paced = figures["paced_after_restart"]
    assert paced["requests"] == 3000 and len(paced["windows"]) == 1 and figures["missing"] == 0
    assert run.stderr.count("resuming from the retained savepoint") == 2  # the restart and the paced one
    assert "right after a restart on the running cluster: " in run.stdout
