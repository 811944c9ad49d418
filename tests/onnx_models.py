"""Small ONNX graphs the tests build for themselves (no downloads)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper, save

from cluster_serving.ops.sample_model import IR_VERSION, OPSET

ML_OPSET = 2  # ai.onnx.ml, for LabelEncoder over strings

WIDTH = 4  # of scale_model's x and y
Spec = tuple[str, int, list]  # name, TensorProto element type, shape after the batch dimension


def graph_model(path: Path, inputs: list[Spec], nodes: list, outputs: list[Spec], initializers: tuple = ()) -> Path:
    """A model whose inputs and outputs all have a free leading batch dimension."""
    graph = helper.make_graph(
        nodes, path.stem,
        [helper.make_tensor_value_info(name, kind, ["batch", *shape]) for name, kind, shape in inputs],
        [helper.make_tensor_value_info(name, kind, ["batch", *shape]) for name, kind, shape in outputs],
        initializer=list(initializers),
    )
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid("ai.onnx.ml", ML_OPSET)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = IR_VERSION
    save(model, str(path))
    return path


def scale_model(path: Path, factor: float) -> Path:
    """y = factor * x: versions differ by their factor, so a result names the version that made it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    weight = numpy_helper.from_array(np.array(factor, np.float32), "factor")
    node = helper.make_node("Mul", ["x", "factor"], ["y"])
    return graph_model(path, [("x", TensorProto.FLOAT, [WIDTH])], [node], [("y", TensorProto.FLOAT, [WIDTH])], (weight,))
