"""What the HTTP bridge knows of the served model: input and output names, dtypes and shapes.

Read from the ONNX file with `onnx` (graph only, no weights, no inference session): the bridge
needs the signature to type JSON numbers and to answer KServe metadata requests, not to run it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx

from connectors.tensors import TensorSpec, onnx_spec, stacks


@dataclass(frozen=True)
class ModelSignature:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @property
    def batched(self) -> bool:
        return stacks(self.inputs)

    def input(self, name: str) -> TensorSpec | None:
        return next((info for info in self.inputs if info.name == name), None)


def tensor_metadata(spec: TensorSpec) -> dict:
    """The tensor as KServe v2 model metadata lists it (-1 for a free dimension)."""
    return {"name": spec.name, "datatype": spec.datatype, "shape": [-1 if d is None else d for d in spec.shape]}


def read_signature(path: Path, outputs: tuple[str, ...] = ()) -> ModelSignature:
    """The model's graph inputs (initializers excluded) and the outputs results will carry."""
    graph = onnx.load(str(path), load_external_data=False).graph
    initializers = {init.name for init in graph.initializer}
    inputs = tuple(_spec(value) for value in graph.input if value.name not in initializers)
    served = [_spec(value) for value in graph.output]
    if outputs:
        served = [info for info in served if info.name in outputs]
    return ModelSignature(inputs, tuple(served))


def _spec(value: onnx.ValueInfoProto) -> TensorSpec:
    """ONNX's element type by the name ONNX Runtime prints (FLOAT -> tensor(float))."""
    tensor = value.type.tensor_type
    onnx_type = f"tensor({onnx.TensorProto.DataType.Name(tensor.elem_type).lower()})"
    dims = [dim.dim_value if dim.HasField("dim_value") else None for dim in tensor.shape.dim]
    return onnx_spec(value.name, onnx_type, dims)
