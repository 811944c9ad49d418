"""`cluster-serving replay` on real parts: a live job serves 10,000 requests with version 1 of a
model; the CLI replays the log through version 2, whose outputs differ in a planted way, into a
side topic beside the running live job, and `--compare` reports the differences the test expects
(computed here with numpy). Also how a range's ends are found in the log."""

from __future__ import annotations

import re
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from cluster_serving.client import InputQueue, OutputQueue
from cluster_serving.kafka.admin import log_positions
from cluster_serving.job.replay import position
from tests.conftest import collect
from tests.onnx_models import WIDTH, graph_model

COUNT = 10_000
# y = x * weights: version 2 weighs the last input more, which changes some requests' top-1.
WEIGHTS = {1: [1.0, 1.0, 1.0, 1.0], 2: [1.0, 1.0, 1.0, 1.5]}


def weigh_model(path: Path, weights: list[float]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    weight = numpy_helper.from_array(np.array(weights, np.float32), "weights")
    node = helper.make_node("Mul", ["x", "weights"], ["y"])
    return graph_model(path, [("x", TensorProto.FLOAT, [WIDTH])], [node], [("y", TensorProto.FLOAT, [WIDTH])], (weight,))


def test_replay_through_another_version_reports_the_planted_differences(write_config, start_job, tmp_path: Path) -> None:
    root = tmp_path / "models"
    for version, weights in WEIGHTS.items():
        weigh_model(root / "weigh" / str(version) / "model.onnx", weights)
    (root / "weigh" / "servable.yaml").write_text(yaml.safe_dump({"version_policy": {"specific": [1]}}))
    path, config = write_config(models={"repository": str(root), "default": "weigh"}, kafka={"partitions": 2})
    start_job(path, config)
    kafka = config.kafka
    x = np.random.default_rng(11).normal(size=(COUNT, WIDTH)).astype(np.float32)
    with InputQueue(kafka.bootstrap_servers, kafka.input_topic) as inputs, OutputQueue(
        kafka.bootstrap_servers, kafka.result_topic, group_id=f"{kafka.group_id}-client"
    ) as outputs:
        inputs.enqueue_batch((f"r-{i}", {"x": row}) for i, row in enumerate(x))
        live = collect(outputs, COUNT, timeout=120)
        assert len(live) == COUNT and {result.version for result in live.values()} == {1}

        side = f"{kafka.input_topic}-replayed"
        replayed = subprocess.run(
            [sys.executable, "-m", "cluster_serving.ops.cli", "replay", "--config", str(path), "--from", "0",
             "--model", "weigh", "--version", "2", "--into", side, "--compare"],
            capture_output=True, text=True, timeout=400,
        )
        assert replayed.returncode == 0, replayed.stderr[-3000:]
        # The live job is untouched: it serves on, with version 1.
        inputs.enqueue("after", x=x[0])
        inputs.flush()
        after = outputs.query("after", timeout=60)
        assert after is not None and after.version == 1
    report = replayed.stdout
    agree = int(np.sum(np.argmax(x * np.float32(WEIGHTS[1]), 1) == np.argmax(x * np.float32(WEIGHTS[2]), 1)))
    assert 0 < agree < COUNT  # the planted difference changes some top-1s, not all
    assert f"replayed: {COUNT} results written to {side}" in report, report
    assert f"compared: {COUNT} replayed results, {COUNT} with a live result for the same uri" in report, report
    assert f"top-1 agreement: {agree} of {COUNT}" in report, report
    largest = float(re.search(r"largest absolute difference: (\S+)", report).group(1))
    assert largest == pytest.approx(float(np.max(np.abs(x[:, 3]) * 0.5)), rel=1e-5)
    assert "errors: 0 in the replay, 0 live" in report
    assert "group_id is None" not in replayed.stderr
    assert re.search(r"replay: \d+ results of \d+ records in range", replayed.stderr), replayed.stderr[-2000:]


def test_the_ends_of_a_range(write_config) -> None:
    path, config = write_config(kafka={"partitions": 2})
    kafka = config.kafka
    from cluster_serving.kafka.admin import ensure_topics

    ensure_topics(kafka)
    before = datetime.now().astimezone() - timedelta(seconds=1)
    with InputQueue(kafka.bootstrap_servers, kafka.input_topic) as inputs:
        inputs.enqueue_batch((f"r-{i}", {"x": np.zeros(2, np.float32)}) for i in range(40))
    ends = log_positions(kafka, kafka.input_topic, None)
    assert sum(ends.values()) == 40 and set(ends) == {0, 1}
    assert log_positions(kafka, kafka.input_topic, 0) == {0: 0, 1: 0}
    assert log_positions(kafka, kafka.input_topic, 10**9) == ends  # kept within the log
    assert log_positions(kafka, kafka.input_topic, before) == {0: 0, 1: 0}
    assert log_positions(kafka, kafka.input_topic, datetime.now().astimezone() + timedelta(hours=1)) == ends
    assert position("12") == 12
    assert position("2026-11-26T10:00:00+00:00") == datetime.fromisoformat("2026-11-26T10:00:00+00:00")
    assert position("2026-11-26T10:00").tzinfo is not None  # local time
    with pytest.raises(Exception, match="neither an offset nor a time"):
        position("yesterday")
