"""What the HTTP bridge knows of the served models: each version's input and output names, dtypes
and shapes, and a pipeline's as its steps make them.

Read from the ONNX files with `onnx` (graph only, no weights, no inference session): the bridge
needs a signature to type JSON numbers and to answer KServe metadata requests, not to run it.
A file is read once per state on disk (its path, modification time and size), so rescanning the
repository costs a `stat` per version.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from cluster_serving.config import ConfigError, ServingConfig
from cluster_serving.runtime.repository import Repository, Servable, checked_scan
from cluster_serving.wire.tensors import TensorError, TensorSpec, config_mismatch, onnx_spec, stacks


@dataclass(frozen=True)
class ModelSignature:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @property
    def batched(self) -> bool:
        return stacks(self.inputs)

    def input(self, name: str) -> TensorSpec | None:
        return next((info for info in self.inputs if info.name == name), None)

    def output(self, name: str) -> TensorSpec | None:
        return next((info for info in self.outputs if info.name == name), None)


def tensor_metadata(spec: TensorSpec) -> dict:
    """The tensor as KServe v2 model metadata lists it (-1 for a free dimension)."""
    return {"name": spec.name, "datatype": spec.datatype, "shape": [-1 if d is None else d for d in spec.shape]}


def read_signature(path: Path) -> ModelSignature:
    """The model's graph inputs (initializers excluded) and outputs."""
    graph = onnx.load(str(path), load_external_data=False).graph
    initializers = {init.name for init in graph.initializer}
    inputs = tuple(_spec(value) for value in graph.input if value.name not in initializers)
    return ModelSignature(inputs, tuple(_spec(value) for value in graph.output))


_cache: dict[Path, tuple[tuple[int, int], ModelSignature]] = {}
_cache_lock = threading.Lock()


def file_signature(path: Path, where: str) -> ModelSignature:
    """`read_signature`, once per state of the file; ConfigError, starting with `where` (the config
    key or the model version it is for), for a file that is missing or not an ONNX model."""
    try:
        stat = path.stat()
    except OSError:
        raise ConfigError(f"{where}: model file not found: {path}") from None
    state = (stat.st_mtime_ns, stat.st_size)
    with _cache_lock:
        cached = _cache.get(path)
    if cached is not None and cached[0] == state:
        return cached[1]
    try:
        signature = read_signature(path)
    except DecodeError as exc:
        raise ConfigError(f"{where}: cannot load model {path}: not an ONNX model ({exc})") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot load model {path}: {exc.strerror or exc}") from None
    except TensorError as exc:
        raise ConfigError(f"{where}: cannot load model {path}: {exc}") from None
    if not signature.inputs or not signature.outputs:
        raise ConfigError(f"{where}: cannot load model {path}: not an ONNX model (no graph inputs or outputs)")
    with _cache_lock:
        _cache[path] = (state, signature)
    return signature


def servable_signature(repository: Repository, servable: Servable, version: int, single: bool = False) -> ModelSignature:
    """The signature requests for `servable`'s `version` are typed by and results carry, checked
    against its servable.yaml (or, `single`, the config's model section) as the job checks it.

    A pipeline's inputs are those its steps take from the request, as the job feeds them: a step
    with an `inputs` mapping takes the request inputs it maps (renamed), the first step without one
    takes its model's inputs as they are; its outputs are its last step's, or those of them its
    `outputs` lists. ConfigError says what does not fit."""
    if servable.is_pipeline:
        return _pipeline_signature(repository, servable)
    where = "model.path" if single else f"models.repository: model {servable.name!r} version {version}"
    signature = file_signature(servable.path(version), where)
    config = servable.config
    problem = config_mismatch(
        [spec.name for spec in signature.inputs], [spec.name for spec in signature.outputs],
        config.inputs, config.outputs, tuple(config.preprocess.images),
    )
    if problem:
        raise ConfigError(problem if single else f"{where}: {problem}")
    served = tuple(spec for spec in signature.outputs if not config.outputs or spec.name in config.outputs)
    return ModelSignature(signature.inputs, served)


def _pipeline_signature(repository: Repository, pipeline: Servable) -> ModelSignature:
    where = f"models.repository: pipeline {pipeline.name!r}"
    inputs: dict[str, TensorSpec] = {}
    earlier: set[str] = set()
    last: tuple[TensorSpec, ...] = ()
    for index, step in enumerate(pipeline.config.steps):
        model = repository.servables.get(step.model)
        if model is None or model.is_pipeline or not model.versions:
            raise ConfigError(f"{where}: step {step.step_name!r}: no model {step.model!r} to serve")
        version = step.version if step.version is not None else model.versions[-1]
        if version not in model.versions:
            raise ConfigError(f"{where}: step {step.step_name!r}: model {step.model!r} serves no version {version}")
        signature = servable_signature(repository, model, version)
        for spec in signature.inputs:
            source = request_input(step.inputs, spec.name, index, earlier)
            if source:
                inputs.setdefault(source, TensorSpec(source, spec.dtype, spec.shape))
        earlier.add(step.step_name)
        last = signature.outputs
    missing = [name for name in pipeline.config.outputs if not any(spec.name == name for spec in last)]
    if missing:
        raise ConfigError(f"{where}: outputs: the last step has no output {missing[0]!r}; it has {[s.name for s in last]}")
    served = tuple(spec for spec in last if not pipeline.config.outputs or spec.name in pipeline.config.outputs)
    return ModelSignature(tuple(inputs.values()), served)


def request_input(mapping: dict[str, str], name: str, index: int, earlier: set[str]) -> str | None:
    """The request input a pipeline step's model input `name` is fed from, if any: the step's
    `inputs` mapping names it (a source not "<earlier step>.<output>"), or, without a mapping, the
    first step takes the request's inputs by their own names."""
    if not mapping:
        return name if index == 0 else None
    source = mapping.get(name)
    if source is None:
        return None
    step, dot, _ = source.partition(".")
    return None if dot and step in earlier else source


def repository_signatures(config: ServingConfig) -> tuple[Repository, dict[tuple[str, int], ModelSignature]]:
    """The repository start serves, every version's signature read and checked: the repository
    (`checked_scan`), a file that is missing or not ONNX, inputs/outputs/images its servable.yaml
    (the config's model section, without a repository) names and the model lacks are one
    ConfigError here, before anything starts. The bridge starts with this, and the CLI checks it."""
    repository = checked_scan(config)
    single = config.models.repository is None
    signatures = {
        (name, version): servable_signature(repository, servable, version, single)
        for name, servable in sorted(repository.servables.items(), key=lambda item: item[1].is_pipeline)
        for version in servable.versions
    }
    return repository, signatures


def _spec(value: onnx.ValueInfoProto) -> TensorSpec:
    """ONNX's element type by the name ONNX Runtime prints (FLOAT -> tensor(float))."""
    tensor = value.type.tensor_type
    onnx_type = f"tensor({onnx.TensorProto.DataType.Name(tensor.elem_type).lower()})"
    dims = [dim.dim_value if dim.HasField("dim_value") else None for dim in tensor.shape.dim]
    return onnx_spec(value.name, onnx_type, dims)
