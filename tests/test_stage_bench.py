"""`cluster-serving bench stage`: the serving stage beside raw ONNX Runtime, in a Python process
that loads neither Flink, nor a Kafka client, nor the HTTP stack."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.paths import PROJECT_ROOT

PROBE = """
import json, sys
from bench.stage import main
main(sys.argv[1:])
print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'pyflink', 'py4j', 'kafka', 'confluent_kafka', 'fastapi', 'uvicorn'})))
"""


def test_the_stage_bench_measures_tensor_and_jpeg_requests_without_kafka_or_flink(tmp_path: Path) -> None:
    out = tmp_path / "stage.json"
    run = subprocess.run(
        [sys.executable, "-c", PROBE, "--model", "conv224", "--inputs", "tensor,jpeg", "--batch", "4,8",
         "--model-instances", "0,2", "--seconds", "0.2", "--threads", "1", "--run-size", "2", "--instances", "2", "--json", str(out)],
        cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip().splitlines()[-1] == "[]"  # none of those modules loaded
    rows = json.loads(out.read_text())
    assert [(row["inputs"], row["batch"], row["model_instances"]) for row in rows] == [
        (inputs, batch, copies) for inputs in ("tensor", "jpeg") for batch in (4, 8) for copies in (1, 2)]  # 0: one copy on the CPU
    for row in rows:  # the copies' runs overlap: up to their count of the stage's time in run
        assert row["raw_ort"] > 0 and row["stage"] > 0 and 0 < row["stage_in_run"] <= row["model_instances"] and row["raw_ort_bound"] is None
        assert row["ratio"] == row["stage"] / row["raw_ort"]
        assert row["run_size"] == 2 and set(row["stage_instances"]) == {"2"} and row["stage_instances"]["2"] > 0
    assert "conv224    jpeg" in run.stdout
    assert "conv224 jpeg batch 8 copies 2, stages at once in processes (req/s together): 1: " in run.stdout


def test_the_command_hands_bench_stage_to_the_stage_bench_in_a_clone(tmp_path: Path) -> None:
    """The installed `cluster-serving` command, as `./run.sh bench` runs it: in the clone it finds
    bench/; elsewhere it says where to run it."""
    command = [str(Path(sys.executable).parent / "cluster-serving"), "bench", "stage", "--model", "nowhere.onnx"]
    run = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.strip() == (
        "error: --model: nowhere.onnx is neither a built-in model (mlp, cnn, conv224, resnet50) nor a file")
    graph = subprocess.run([*command[:3], "--cuda-graph"], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert graph.returncode == 2 and graph.stderr.strip() == "error: --cuda-graph needs --device cuda and --run-size 0"
    elsewhere = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert elsewhere.returncode == 2 and elsewhere.stderr.strip() == (
        "error: bench/ is not in the working folder: it runs from a clone of the repository (./run.sh bench)")
