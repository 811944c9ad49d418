"""README command one, as a user runs it: the demo prints predictions and stops what it started."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cluster_serving.net.ports import port_taken
from cluster_serving.ops.instances import RECORD_FILE, REGISTRY_ENV

ROOT = Path(__file__).resolve().parent.parent


DEMO_PORTS = (9092, 8081, 10020)  # broker, Flink web UI, HTTP bridge


@pytest.mark.skipif(
    any(port_taken("127.0.0.1", port) for port in DEMO_PORTS),
    reason="the demo's fixed ports 9092 (broker), 8081 (Flink UI) or 10020 (HTTP) are taken on this machine",
)
def test_demo_prints_predictions_and_cleans_up(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cluster_serving.ops.cli", "demo", "--no-wait", "--requests", "3", "--folder", str(tmp_path)],
        cwd=ROOT, env={**os.environ, REGISTRY_ENV: str(tmp_path / "registry")}, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Flink web UI: http://127.0.0.1:8081" in result.stdout
    predictions = re.findall(r"^demo-(\d): class (\d) \(p=[01]\.\d{3}\)$", result.stdout, re.MULTILINE)
    assert sorted(uri for uri, _ in predictions) == ["0", "1", "2"], result.stdout
    assert re.search(r"^POST http://127\.0\.0\.1:10020/predict: class \d \(p=[01]\.\d{3}\)$", result.stdout, re.MULTILINE)
    assert (tmp_path / "config.yaml").is_file() and (tmp_path / "model.onnx").is_file()
    assert not any(port_taken("127.0.0.1", port) for port in DEMO_PORTS)
    assert not (tmp_path / RECORD_FILE).exists() and list((tmp_path / "registry").iterdir()) == []
