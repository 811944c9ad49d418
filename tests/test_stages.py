"""Stage functions and pipeline steps in memory (cluster_serving/runtime/stages.py, cluster_serving/runtime/serve.py), without Flink: a
stage's problem is its request's error result, and a pipeline step without a model open is an error
result for the batch, never an exception that would restart the job."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from cluster_serving.config import load_config
from cluster_serving.runtime.repository import RoutingTable, scan
from cluster_serving.runtime.servables import Served
from cluster_serving.runtime.serve import BatchServer
from cluster_serving.runtime.stages import apply_stage
from cluster_serving.wire.codec import Message
from tests.onnx_models import scale_model


def messages(*values: float) -> list[Message]:
    return [Message(f"u{i}", {"x": np.full(2, value, np.float32)}) for i, value in enumerate(values)]


def refuse_negative(inputs: dict) -> dict:
    if inputs["x"][0] < 0:
        raise ValueError("negative")
    return {"x": inputs["x"] + 1}


def test_a_per_instance_stage_fails_only_the_instances_it_raises_on() -> None:
    kept, errors = apply_stage(refuse_negative, False, messages(1, -1, 2), "preprocess")
    assert [m.uri for m in kept] == ["u0", "u2"] and kept[1].tensors["x"].tolist() == [3, 3]
    assert [(m.uri, m.error, m.error_code) for m in errors] == [("u1", "preprocess failed: ValueError: negative", "preprocess_failed")]


def test_a_batched_stage_that_raises_is_called_again_one_instance_at_a_time() -> None:
    calls: list[int] = []

    def batched(batch: list[dict]) -> list[dict]:
        calls.append(len(batch))
        return [refuse_negative(inputs) for inputs in batch]

    kept, errors = apply_stage(batched, True, messages(1, -1, 2), "preprocess")
    assert calls == [3, 1, 1, 1]
    assert [m.uri for m in kept] == ["u0", "u2"] and [m.uri for m in errors] == ["u1"]


@pytest.mark.parametrize("output, problem", [(None, "must return a dict"), ([{"x": 1}, {"x": 2}], "must return a list of 1")])
def test_a_stage_returning_something_else_is_an_error_result(output, problem) -> None:
    batched = isinstance(output, list)
    kept, errors = apply_stage(lambda _: output, batched, messages(1, 2, 3), "postprocess")
    assert not kept and len(errors) == 3
    assert all(problem in m.error and m.error.startswith("postprocess failed: ") and m.error_code == "postprocess_failed" for m in errors)


def test_a_pipeline_step_without_an_open_model_answers_errors(tmp_path: Path) -> None:
    root = tmp_path / "models"
    scale_model(root / "scale" / "1" / "model.onnx", 2.0)
    (root / "chain").mkdir()
    (root / "chain" / "servable.yaml").write_text(yaml.safe_dump({"kind": "pipeline", "steps": [{"model": "scale"}]}))
    config = load_config(overrides={"models.repository": str(root)})
    stage = BatchServer(config)
    chain = Served(scan(config).servables["chain"], None, None, {})
    outcomes = stage.serve(chain, 1, [Message("u0", {"x": np.ones(4, np.float32)})])
    assert [(m.uri, m.error, m.error_code) for m in outcomes] == [
        ("u0", "pipeline 'chain': model 'scale' version newest is not open", "internal")]


def test_a_pipeline_step_is_served_with_its_models_own_stages(tmp_path: Path) -> None:
    root = tmp_path / "models"
    scale_model(root / "scale" / "1" / "model.onnx", 2.0)
    (root / "scale" / "servable.yaml").write_text(yaml.safe_dump({"preprocess": {"function": "plus_one"}}))
    (root / "scale" / "servable.py").write_text("def plus_one(inputs):\n    return {'x': inputs['x'] + 1}\n")
    (root / "chain").mkdir()
    (root / "chain" / "servable.yaml").write_text(yaml.safe_dump(
        {"kind": "pipeline", "steps": [{"model": "scale"}, {"name": "again", "model": "scale", "inputs": {"x": "scale.y"}}]}
    ))
    config = load_config(overrides={"models.repository": str(root), "models.default": "scale"})
    stage = BatchServer(config)
    stage.servables.adopt(RoutingTable.of(scan(config)))
    served, version = stage.servables.resolve("chain", "")
    [result] = stage.serve(served, version, [Message("u0", {"x": np.zeros(4, np.float32)})])
    np.testing.assert_array_equal(result.tensors["y"], np.full(4, ((0 + 1) * 2 + 1) * 2, np.float32))
