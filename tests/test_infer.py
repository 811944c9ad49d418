"""Batch inference on real ONNX models: grouping, casting, and isolation of failing requests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from connectors.codec import Message
from job.infer import predict
from job.model import ModelError, OnnxModel

TABLE = np.arange(30, dtype=np.float32).reshape(10, 3)


@pytest.fixture(scope="module")
def lookup_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """row int64 [batch] -> Gather(TABLE) -> values float32 [batch, 3]; an index >= 10 makes
    ONNX Runtime raise at run time, which no input check can see beforehand."""
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "row"], ["values"], axis=0)],
        "lookup",
        [helper.make_tensor_value_info("row", TensorProto.INT64, ["batch"])],
        [helper.make_tensor_value_info("values", TensorProto.FLOAT, ["batch", 3])],
        initializer=[numpy_helper.from_array(TABLE, "table")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path_factory.mktemp("lookup") / "lookup.onnx"
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def lookup_model(lookup_path: Path) -> OnnxModel:
    return OnnxModel(lookup_path, "cpu")


def by_uri(results: list[Message]) -> dict[str, Message]:
    assert len({result.uri for result in results}) == len(results)
    return {result.uri: result for result in results}


def test_a_failing_request_does_not_fail_its_batch(lookup_model: OnnxModel) -> None:
    rows = [3, 99, 0, 7]  # 99 is out of range
    results = by_uri(predict(lookup_model, [Message(f"r{i}", {"row": np.array(row)}) for i, row in enumerate(rows)]))
    assert "inference failed" in results["r1"].error
    for i in (0, 2, 3):
        np.testing.assert_array_equal(results[f"r{i}"].tensors["values"], TABLE[rows[i]])
        assert results[f"r{i}"].batch_size == 1  # re-run alone after the stacked run failed


def test_requests_are_stacked_and_checked(lookup_model: OnnxModel) -> None:
    requests = [Message(f"ok{i}", {"row": np.array(i, dtype=np.int32)}) for i in range(5)]  # int32 -> int64
    requests += [
        Message("float", {"row": np.array(1.0)}),
        Message("matrix", {"row": np.zeros((2, 2), np.int64)}),
        Message("missing", {}),
        Message("extra", {"row": np.array(1), "other": np.array(2)}),
    ]
    results = by_uri(predict(lookup_model, requests))
    for i in range(5):
        assert results[f"ok{i}"].batch_size == 5
        np.testing.assert_array_equal(results[f"ok{i}"].tensors["values"], TABLE[i])
    assert "expects int64, got float64" in results["float"].error
    assert "shape (2, 2) does not fit ()" in results["matrix"].error
    assert "missing input 'row'" in results["missing"].error
    assert "unknown input 'other'" in results["extra"].error


def test_configured_names_must_match_the_model(lookup_path: Path) -> None:
    path = lookup_path
    with pytest.raises(ModelError, match="model.inputs \\['x'\\] do not match the model's inputs \\['row'\\]"):
        OnnxModel(path, "cpu", inputs=("x",))
    with pytest.raises(ModelError, match="model.outputs: the model has no output 'probs'"):
        OnnxModel(path, "cpu", outputs=("probs",))
    with pytest.raises(ModelError, match="cannot load model"):
        OnnxModel(path.with_name("absent.onnx"), "cpu")
