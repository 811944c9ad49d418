"""The sample model of `cluster-serving init` and the demo: a small classifier built locally.

features float32 [batch, 16] -> Gemm 16x32 -> Relu -> Gemm 32x10 -> Softmax -> probabilities [batch, 10].
Weights come from a fixed seed, so every build is the same model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FEATURES = 16
CLASSES = 10
# The ONNX opset and IR version the sample is written with; every onnxruntime >= 1.16 reads them.
OPSET = 17
IR_VERSION = 8


def build_sample_model(path: Path, hidden: int = 32, seed: int = 7) -> Path:
    rng = np.random.default_rng(seed)
    weights = [
        numpy_helper.from_array(rng.normal(0, 0.5, (FEATURES, hidden)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.1, (hidden,)).astype(np.float32), "b1"),
        numpy_helper.from_array(rng.normal(0, 0.5, (hidden, CLASSES)).astype(np.float32), "w2"),
        numpy_helper.from_array(rng.normal(0, 0.1, (CLASSES,)).astype(np.float32), "b2"),
    ]
    nodes = [
        helper.make_node("Gemm", ["features", "w1", "b1"], ["hidden"]),
        helper.make_node("Relu", ["hidden"], ["activated"]),
        helper.make_node("Gemm", ["activated", "w2", "b2"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "sample_classifier",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", FEATURES])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", CLASSES])],
        initializer=weights,
    )
    return save_graph(graph, path)


def save_graph(graph: onnx.GraphProto, path: Path) -> Path:
    """Writes a graph as a checked model at the opset and IR version every onnxruntime >= 1.16 reads."""
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path
