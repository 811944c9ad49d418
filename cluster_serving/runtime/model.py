"""An ONNX Runtime session with what the job needs around it: provider choice, input checks,
stacking instances into one batched run and splitting the outputs again."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from cluster_serving.config import ImageConfig
from cluster_serving.runtime.device_io import CUDA_WORK, BoundRunner, graph_run_options
from cluster_serving.runtime.outcomes import InvalidInput
from cluster_serving.runtime.preprocess import BatchArray
from cluster_serving.wire.tensors import TensorError, TensorSpec, cast_changes_values, config_mismatch, onnx_spec, stacks

log = logging.getLogger(__name__)


class ModelError(RuntimeError):
    """The model cannot be served as configured (load failure, unusable device, name mismatch)."""


def open_session(path: Path, device: str, threads: int = 1, model: bytes | None = None,
                 cuda_graph: bool = False) -> ort.InferenceSession:
    """Opens the model on CUDA when asked for and usable, else on the CPU; `cuda` never falls back.

    `model`: the model's bytes, when they are not the file's (rewrites.py's). `cuda_graph`: on
    CUDA, with ONNX Runtime's CUDA graphs enabled (device_io.GraphRun). `threads`: ONNX
    Runtime's intra-op threads (0: one per core, its default). Its pool threads
    never spin-wait for work: spinning kept a core busy between batches, the core the Kafka
    clients, the broker and the JVM needed."""
    want_cuda = device in ("auto", "cuda") and "CUDAExecutionProvider" in ort.get_available_providers()
    if device == "cuda" and not want_cuda:
        raise ModelError("device is 'cuda' but this onnxruntime build has no CUDA provider")
    cuda = ("CUDAExecutionProvider", {"enable_cuda_graph": "1"} if cuda_graph else {})
    providers = [cuda, "CPUExecutionProvider"] if want_cuda else ["CPUExecutionProvider"]
    # A CPU-only machine is normal for `auto`: keep ONNX Runtime's CUDA load errors out of the log.
    ort.set_default_logger_severity(4 if device == "auto" else 2)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        with CUDA_WORK.shared() if want_cuda else contextlib.nullcontext():
            session = ort.InferenceSession(model or str(path), options, providers=providers)
    except Exception as exc:
        raise ModelError(f"cannot load model {path}: {exc}") from None
    finally:
        ort.set_default_logger_severity(2)
    active = session.get_providers()[0]
    if device == "cuda" and active != "CUDAExecutionProvider":
        raise ModelError("device is 'cuda' but CUDA is not usable here (no GPU or CUDA libraries)")
    return session


class OnnxModel:
    """The served model. Input and output names are checked against the config once, at open.

    On a GPU (or wherever `on_device` says), batches move through a BoundRunner (device_io.py)
    and the image inputs in `images` are normalised by nodes in front of the model
    (rewrites.py): `images` then says how the host decodes them, as plain pixels. `float16`
    runs the model in float16 (rewrites.py), its inputs and outputs unchanged. `graph_rows`
    (model.cuda_graph: the batches' rows): on CUDA, batches of that many rows replay a CUDA graph;
    wherever `on_device` says, they run from buffers bound once (device_io.GraphRun)."""

    def __init__(
        self, path: Path, device: str, inputs: tuple[str, ...] = (), outputs: tuple[str, ...] = (), threads: int = 1,
        images: dict[str, ImageConfig] | None = None, on_device: bool | None = None, float16: bool = False,
        graph_rows: int = 0,
    ):
        self.cuda_graph = graph_rows > 0
        self.session = open_session(path, device, threads, cuda_graph=self.cuda_graph)
        self.provider = self.session.get_providers()[0]
        self.images = dict(images or {})
        self.on_device = self.provider == "CUDAExecutionProvider" if on_device is None else on_device
        if float16 or (self.on_device and self.images):
            self._rewrite(path, device, threads, float16)
        try:
            self.inputs = [onnx_spec(node.name, node.type, node.shape) for node in self.session.get_inputs()]
        except TensorError as exc:
            raise ModelError(str(exc)) from None
        model_outputs = [node.name for node in self.session.get_outputs()]
        problem = config_mismatch([spec.name for spec in self.inputs], model_outputs, inputs, outputs)
        if problem:
            raise ModelError(problem)
        self.output_names = list(outputs) or model_outputs
        self.batched = stacks(self.inputs)
        # Request layouts (format v2) checked once to fit the model as they are, no cast needed:
        # an alike batch of one of them is not checked again (infer.predict_alike).
        self.fitting_layouts: set[bytes] = set()
        bindable = self.on_device and all(spec.dtype.kind != "O" for spec in self.inputs)
        self.run_options = graph_run_options(-1) if self.cuda_graph else None  # runs outside the graph
        self.runner = BoundRunner(
            self.session, self.output_names, "cuda" if self.provider == "CUDAExecutionProvider" else "cpu", graph_rows if bindable else 0,
        ) if bindable else None

    def _rewrite(self, path: Path, device: str, threads: int, float16: bool) -> None:
        """Reopens the session on the model as rewrites.py changes it: in float16 when asked for
        (a ModelError where it cannot be), and on the device path with nodes in front that
        normalise its images. Where those nodes cannot be (no onnx package, a graph that cannot
        take them), the host keeps normalising: same results, more bytes to the device."""
        try:
            from cluster_serving.runtime import rewrites  # needs onnx, which the runtime does without elsewhere
        except ImportError as exc:
            if float16:
                raise ModelError(f"model.float16 needs the onnx package: {exc}") from None
            log.warning("model %s: images stay normalised on the host: %s", path, exc)
            return
        images = rewrites.normalised_in_graph(self.images) if self.on_device else {}
        if not (float16 or images):
            return
        model = rewrites.load(path)
        if float16:
            try:
                model = rewrites.float16(model)
            except Exception as exc:
                raise ModelError(f"cannot convert model {path} to float16: {exc}") from None
        if images:
            try:
                self.session = open_session(path, device, threads, rewrites.with_pixel_inputs(model, images).SerializeToString(), self.cuda_graph)
            except Exception as exc:
                log.warning("model %s: images stay normalised on the host: %s", path, exc)
            else:
                self.images |= {name: rewrites.pixels_only(config) for name, config in images.items()}
                return
        if float16:
            self.session = open_session(path, device, threads, model.SerializeToString(), self.cuda_graph)

    def batch_array(self, name: str) -> BatchArray:
        """Makes the array a batch's images of input `name` are decoded into: the runner's
        page-locked buffer on the device path, else a new one."""
        if self.runner is None:
            return np.empty
        return lambda shape, dtype: self.runner.decode_buffer(name, shape[0], shape[1:], dtype)

    def prepare(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Checks one instance against the model and casts within a dtype kind (float64 -> float32)."""
        unknown = sorted(set(tensors) - {spec.name for spec in self.inputs})
        if unknown:
            raise InvalidInput(f"unknown input {unknown[0]!r}; the model takes {self._input_names()}")
        return {spec.name: self._prepare_one(spec, tensors) for spec in self.inputs}

    def _prepare_one(self, spec: TensorSpec, tensors: dict[str, np.ndarray]) -> np.ndarray:
        if spec.name not in tensors:
            raise InvalidInput(f"missing input {spec.name!r}; the model takes {self._input_names()}")
        value = tensors[spec.name]
        expected = spec.shape[1:] if self.batched else spec.shape
        if value.ndim != len(expected) or any(
            want is not None and want != got for want, got in zip(expected, value.shape)
        ):
            shown = tuple("?" if dim is None else dim for dim in expected)
            raise InvalidInput(f"input {spec.name!r}: shape {value.shape} does not fit {shown}")
        if spec.dtype.kind == "O":
            if value.dtype.kind not in "OU":
                raise InvalidInput(f"input {spec.name!r}: expects strings, got {value.dtype}")
            return value.astype(object)
        if not _castable(value.dtype, spec.dtype):
            raise InvalidInput(f"input {spec.name!r}: expects {spec.dtype}, got {_described(value.dtype)}")
        _check_range(spec, value)
        return value.astype(spec.dtype, copy=False)

    def casts(self, tensors: dict[str, np.ndarray]) -> bool:
        """Whether these tensors' dtypes differ from the model's, so their values need checking
        (`check_values`) per request even when their layout was checked once."""
        return any(spec.name in tensors and tensors[spec.name].dtype != spec.dtype for spec in self.inputs)

    def check_values(self, tensors: dict[str, np.ndarray]) -> None:
        """Raises InvalidInput for values the cast to the model's dtypes would change."""
        for spec in self.inputs:
            if spec.name in tensors and spec.dtype.kind != "O":
                _check_range(spec, tensors[spec.name])

    def run_stacked(self, feeds: list[dict[str, np.ndarray]], run_size: int = 0) -> dict[str, np.ndarray]:
        """Instances that share a shape signature, stacked along a new first dimension and cast
        to the model's dtypes (a no-op for prepared ones), run `run_size` rows at a time (0: all
        in one run); row i of each output belongs to feeds[i]. Batched models only."""
        return self.run_columns({spec.name: [feed[spec.name] for feed in feeds] for spec in self.inputs}, run_size)

    def run_columns(self, columns: dict[str, Sequence[np.ndarray]], run_size: int = 0) -> dict[str, np.ndarray]:
        """Each input's rows (a list of them, or an array stacked already), run `run_size` rows at
        a time (0: all in one run); row i of each output belongs to row i of the inputs."""
        count = len(next(iter(columns.values())))
        step = run_size or count
        runs = [self._run_rows({name: rows[start:start + step] for name, rows in columns.items()})
                for start in range(0, count, step)]
        if len(runs) == 1:
            return runs[0]
        return {name: np.concatenate([run[name] for run in runs]) for name in self.output_names}

    def _run_rows(self, columns: dict[str, list[np.ndarray]]) -> dict[str, np.ndarray]:
        rows = len(next(iter(columns.values())))
        if self.runner is not None:
            outputs = self.runner.run(columns, {spec.name: spec.dtype for spec in self.inputs})
        else:
            stacked = {spec.name: stack_rows(columns[spec.name]).astype(spec.dtype, copy=False) for spec in self.inputs}
            with self._cuda_work():
                outputs = self.session.run(self.output_names, stacked, self.run_options)
        for name, value in zip(self.output_names, outputs):
            if value.ndim == 0 or value.shape[0] != rows:
                raise ModelError(f"output {name!r} does not keep the batch dimension")
        return dict(zip(self.output_names, outputs))

    def run_one(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One prepared instance, as it is: for models without a free batch dimension."""
        with self._cuda_work():
            return dict(zip(self.output_names, self.session.run(self.output_names, feed, self.run_options)))

    def _cuda_work(self) -> contextlib.AbstractContextManager[None]:
        """Runs outside the BoundRunner on CUDA share device_io.CUDA_WORK with the others."""
        return CUDA_WORK.shared() if self.provider == "CUDAExecutionProvider" else contextlib.nullcontext()

    def _input_names(self) -> str:
        return ", ".join(spec.name for spec in self.inputs)


def stack_rows(rows: Sequence[np.ndarray]) -> np.ndarray:
    """The rows as one array along a new first dimension: when they lie one after another in
    memory already (decode_images lays a batch's images out so), a view of them, not a copy."""
    if isinstance(rows, np.ndarray):
        return rows
    first = rows[0]
    step = first.nbytes
    if first.flags.c_contiguous and all(
        row.dtype == first.dtype and row.shape == first.shape and row.flags.c_contiguous
        and row.ctypes.data == first.ctypes.data + i * step
        for i, row in enumerate(rows)
    ):
        # Each row is memory an array holds and they adjoin: the span is theirs while the caller
        # keeps the rows, as run_stacked does for its runs. Read only.
        return np.lib.stride_tricks.as_strided(first, (len(rows), *first.shape), (step, *first.strides), writeable=False)
    return np.stack(rows)


def _castable(got: np.dtype, want: np.dtype) -> bool:
    """The documented rule (docs/client.md): a cast within a kind (float64 -> float32, int32 -> int64), or an unsigned
    integer into a signed one that holds all its values (uint8 -> int64). Never across kinds, which
    numpy's "same_kind" allows: int or bool -> float would turn ids and flags into numbers silently,
    and uint64 -> float32 loses digits."""
    if got.kind == want.kind:
        return True
    return got.kind == "u" and want.kind == "i" and np.can_cast(got, want, casting="safe")


def _check_range(spec: TensorSpec, value: np.ndarray) -> None:
    """A cast within a kind is allowed, but not one that changes a value: int64 2**40 into an int32
    input would wrap, float64 1e39 into a float32 one would become infinity."""
    if cast_changes_values(value, spec.dtype):
        raise InvalidInput(f"input {spec.name!r}: values outside the range of {spec.dtype}")


def _described(dtype: np.dtype) -> str:
    """A request's dtype as a refusal names it: strings reach the job as numpy object (or unicode)
    arrays, a dtype the user never wrote."""
    return "strings" if dtype.kind in "OU" else dtype.name
