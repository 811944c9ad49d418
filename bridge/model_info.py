"""What the HTTP bridge knows of the served model: input and output names, dtypes and shapes.

Read from the ONNX file with `onnx` (graph only, no weights, no inference session): the bridge
needs the signature to type JSON numbers and to answer KServe metadata requests, not to run it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from conf import ConfigError, ServingConfig
from connectors.tensors import TensorError, TensorSpec, config_mismatch, onnx_spec, stacks


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


def read_signature(path: Path) -> ModelSignature:
    """The model's graph inputs (initializers excluded) and outputs."""
    graph = onnx.load(str(path), load_external_data=False).graph
    initializers = {init.name for init in graph.initializer}
    inputs = tuple(_spec(value) for value in graph.input if value.name not in initializers)
    return ModelSignature(inputs, tuple(_spec(value) for value in graph.output))


def model_signature(config: ServingConfig) -> ModelSignature:
    """The model's signature with the outputs results will carry, checked against the config as the
    job checks it: a missing file, one that is not ONNX, `model.inputs` or `model.outputs` the model
    lacks, or image settings for an input it lacks are one ConfigError here, before anything starts
    (the bridge reads the model through this, and the CLI checks it with it too)."""
    path = config.model.path
    if not path.is_file():
        raise ConfigError(f"model.path: model file not found: {path}")
    try:
        signature = read_signature(path)
    except DecodeError as exc:
        raise ConfigError(f"model.path: cannot load model {path}: not an ONNX model ({exc})") from None
    except OSError as exc:
        raise ConfigError(f"model.path: cannot load model {path}: {exc.strerror or exc}") from None
    except TensorError as exc:
        raise ConfigError(f"model.path: cannot load model {path}: {exc}") from None
    if not signature.inputs or not signature.outputs:
        raise ConfigError(f"model.path: cannot load model {path}: not an ONNX model (no graph inputs or outputs)")
    problem = config_mismatch(
        [spec.name for spec in signature.inputs], [spec.name for spec in signature.outputs],
        config.model.inputs, config.model.outputs, tuple(config.preprocess.images),
    )
    if problem:
        raise ConfigError(problem)
    served = tuple(spec for spec in signature.outputs if not config.model.outputs or spec.name in config.model.outputs)
    return ModelSignature(signature.inputs, served)


def _spec(value: onnx.ValueInfoProto) -> TensorSpec:
    """ONNX's element type by the name ONNX Runtime prints (FLOAT -> tensor(float))."""
    tensor = value.type.tensor_type
    onnx_type = f"tensor({onnx.TensorProto.DataType.Name(tensor.elem_type).lower()})"
    dims = [dim.dim_value if dim.HasField("dim_value") else None for dim in tensor.shape.dim]
    return onnx_spec(value.name, onnx_type, dims)
