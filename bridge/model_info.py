"""What the HTTP bridge knows of the served model: input and output names, dtypes and shapes.

Read from the ONNX file with `onnx` (graph only, no weights, no inference session): the bridge
needs the signature to type JSON numbers and to answer KServe metadata requests, not to run it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

# numpy dtype -> the open inference protocol's datatype names.
V2_DATATYPES: dict[str, str] = {
    "bool": "BOOL", "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32", "uint64": "UINT64",
    "int8": "INT8", "int16": "INT16", "int32": "INT32", "int64": "INT64",
    "float16": "FP16", "float32": "FP32", "float64": "FP64", "object": "BYTES",
}
NUMPY_DTYPES: dict[str, np.dtype] = {v2: np.dtype(name) for name, v2 in V2_DATATYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: np.dtype  # object for strings
    shape: tuple[int | None, ...]  # None: symbolic or unknown

    @property
    def datatype(self) -> str:
        return V2_DATATYPES[self.dtype.name]

    def metadata(self) -> dict:
        """The tensor as KServe v2 model metadata lists it (-1 for a free dimension)."""
        return {"name": self.name, "datatype": self.datatype, "shape": [-1 if d is None else d for d in self.shape]}


@dataclass(frozen=True)
class ModelSignature:
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]

    @property
    def batched(self) -> bool:
        """As in the job: instances are stacked only when every input has a free first dimension."""
        return bool(self.inputs) and all(info.shape and info.shape[0] is None for info in self.inputs)

    def input(self, name: str) -> TensorInfo | None:
        return next((info for info in self.inputs if info.name == name), None)


def read_signature(path: Path, outputs: tuple[str, ...] = ()) -> ModelSignature:
    """The model's graph inputs (initializers excluded) and the outputs results will carry."""
    graph = onnx.load(str(path), load_external_data=False).graph
    initializers = {init.name for init in graph.initializer}
    inputs = tuple(_tensor_info(value) for value in graph.input if value.name not in initializers)
    served = [_tensor_info(value) for value in graph.output]
    if outputs:
        served = [info for info in served if info.name in outputs]
    return ModelSignature(inputs, tuple(served))


def _tensor_info(value: onnx.ValueInfoProto) -> TensorInfo:
    tensor = value.type.tensor_type
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.elem_type))
    shape = tuple(dim.dim_value if dim.HasField("dim_value") else None for dim in tensor.shape.dim)
    return TensorInfo(value.name, dtype, shape)
