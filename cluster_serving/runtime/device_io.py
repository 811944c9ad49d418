"""How a batch reaches the device and its results come back, when the model runs on a GPU.

Each input's rows are written into one reused host buffer, page-locked on CUDA so that the copy
to the device is one DMA transfer, and bound to the session (I/O binding); outputs stay on the
device until the run ends and are copied back once per batch. Images are decoded straight into a
second such buffer (`decode_buffer`), which is then bound as it is. The CPU provider accepts bound
inputs too, which is how the tests cover this path on machines without a GPU.

With `model.cuda_graph`, a full batch's run is recorded once as a CUDA graph by ONNX Runtime and
replayed after (`GraphRun`): its inputs and outputs then stay at fixed addresses on the device.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import threading
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnxruntime as ort

log = logging.getLogger(__name__)
# The CUDA runtime that ONNX Runtime's CUDA provider links: loaded already once a CUDA session opened.
CUDA_RUNTIME = "libcudart.so.13"
# Batches of this many bytes or more are copied into place by a BoundRunner's copy_threads.
PARALLEL_COPY_BYTES = 4 << 20
COPY_THREADS = min(os.cpu_count() or 1, 8)
# A GraphRun's first replays, run alone: ONNX Runtime records the graph during one of them.
RECORDING_RUNS = 3


class SharedExclusiveLock:
    """Held by many threads at once, or by one alone, which waits for the others to leave and
    keeps new ones out meanwhile. ONNX Runtime records a CUDA graph in CUDA's global capture
    mode, where any other thread's CUDA call would break the recording: recording holds
    `CUDA_WORK` alone, every other piece of CUDA work in the process holds it shared."""

    def __init__(self):
        self.changed = threading.Condition()
        self.sharing = 0
        self.alone = False
        self.waiting_alone = 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self.changed:
            self.changed.wait_for(lambda: not self.alone and not self.waiting_alone)
            self.sharing += 1
        try:
            yield
        finally:
            with self.changed:
                self.sharing -= 1
                self.changed.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self.changed:
            self.waiting_alone += 1
            self.changed.wait_for(lambda: not self.alone and not self.sharing)
            self.waiting_alone -= 1
            self.alone = True
        try:
            yield
        finally:
            with self.changed:
                self.alone = False
                self.changed.notify_all()


CUDA_WORK = SharedExclusiveLock()


def page_locked(shape: tuple[int, ...], dtype: np.dtype, device: str) -> np.ndarray:
    """A host array; on CUDA registered as page-locked memory (cudaHostRegister) for the life of
    the array. Where registering fails, the array stays pageable: slower copies, same results."""
    array = np.empty(shape, dtype)
    if device != "cuda" or array.nbytes == 0:
        return array
    try:
        cuda = ctypes.CDLL(CUDA_RUNTIME)
        status = cuda.cudaHostRegister(ctypes.c_void_p(array.ctypes.data), ctypes.c_size_t(array.nbytes), 0)
    except OSError as exc:
        log.warning("host buffers stay pageable: %s", exc)
        return array
    if status != 0:
        log.warning("host buffers stay pageable: cudaHostRegister returned %d", status)
        return array
    weakref.finalize(array, cuda.cudaHostUnregister, ctypes.c_void_p(array.ctypes.data))
    return array


class HostBuffer:
    """One input's reused batch array, grown to the most rows asked for."""

    def __init__(self, device: str):
        self.device = device
        self.array = np.empty(0)

    def rows(self, count: int, row_shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """The first `count` rows, of this shape and dtype (a new buffer when they do not fit)."""
        have = self.array
        if have.dtype != dtype or have.shape[1:] != row_shape or len(have) < count:
            self.array = page_locked((max(count, len(have) if have.shape[1:] == row_shape else 0), *row_shape), dtype, self.device)
        return self.array[:count]

    def holds(self, rows: Sequence[np.ndarray]) -> bool:
        """Whether `rows` are this buffer's first rows, in order: written there by a decoder."""
        array = self.array
        return (
            0 < len(rows) <= len(array)
            and all(row.shape == array.shape[1:] and row.dtype == array.dtype for row in rows)
            and all(row.ctypes.data == array[i].ctypes.data for i, row in enumerate(rows))
        )


def graph_run_options(graph_id: int) -> ort.RunOptions:
    """Run options of a session opened with CUDA graphs: replay (or record) graph `graph_id`, or
    with -1 run as usual."""
    options = ort.RunOptions()
    options.add_run_config_entry("gpu_graph_id", str(graph_id))
    return options


class GraphRun:
    """Batches of one signature (rows, shapes, dtypes) run as ONNX Runtime's CUDA graph 0 of a
    session: inputs and outputs bound once, to buffers on the device that each run fills and
    reads, since a replayed graph reads and writes the addresses it was recorded with."""

    def __init__(self, session: ort.InferenceSession, batches: dict[str, np.ndarray], output_names: list[str], device: str):
        self.session = session
        self.signature = signature(batches)
        self.binding = session.io_binding()
        self.inputs = {name: ort.OrtValue.ortvalue_from_numpy(batch, device, 0) for name, batch in batches.items()}
        for name, value in self.inputs.items():
            self.binding.bind_ortvalue_input(name, value)
        for name in output_names:
            self.binding.bind_output(name, device)
        session.run_with_iobinding(self.binding, graph_run_options(-1))  # a plain run, for the outputs' shapes
        shapes = [(value.shape(), value.numpy().dtype) for value in self.binding.get_outputs()]
        self.binding.clear_binding_outputs()
        self.outputs = [ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, device, 0) for shape, dtype in shapes]
        for name, value in zip(output_names, self.outputs):
            self.binding.bind_ortvalue_output(name, value)
        self.options = graph_run_options(0)
        self.replays = 0

    @property
    def recording(self) -> bool:
        return self.replays < RECORDING_RUNS

    def run(self, batches: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The outputs of one replay over `batches` (of this run's signature), copied to the host."""
        for name, batch in batches.items():
            self.inputs[name].update_inplace(batch)
        self.session.run_with_iobinding(self.binding, self.options)
        self.replays += 1
        return [value.numpy() for value in self.outputs]


def signature(batches: dict[str, np.ndarray]) -> tuple[tuple[str, tuple[int, ...], np.dtype], ...]:
    return tuple((name, batch.shape, batch.dtype) for name, batch in batches.items())


class BoundRunner:
    """Runs one session with I/O binding and reused host buffers, one per input. With
    `graph_rows`, batches of that many rows replay a CUDA graph (GraphRun), the first such
    batch's signature only; the session must be opened with CUDA graphs enabled."""

    def __init__(self, session: ort.InferenceSession, output_names: list[str], device: str, graph_rows: int = 0):
        self.session = session
        self.output_names = output_names
        self.device = device  # where outputs are bound: "cuda" or "cpu"
        self.binding = session.io_binding()
        self.staging: dict[str, HostBuffer] = {}
        self.decoded: dict[str, HostBuffer] = {}
        self.copy_threads = COPY_THREADS  # 1 where copies of the model run side by side (servables.py)
        self.graph_rows = graph_rows
        self.graph: GraphRun | None = None
        self.plain_options = graph_run_options(-1) if graph_rows else None

    def decode_buffer(self, name: str, count: int, row_shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """Where a batch's decoded images of input `name` go, so that the run binds them as they lie."""
        with CUDA_WORK.shared():  # a new buffer is page-locked: a CUDA call
            return self.decoded.setdefault(name, HostBuffer(self.device)).rows(count, row_shape, np.dtype(dtype))

    def run(self, columns: dict[str, Sequence[np.ndarray]], dtypes: dict[str, np.dtype]) -> list[np.ndarray]:
        """The outputs of one run over `columns` (an input's rows each), cast to `dtypes`; alone
        in the process while it may record a CUDA graph."""
        recording = len(next(iter(columns.values()))) == self.graph_rows and (self.graph is None or self.graph.recording)
        with CUDA_WORK.exclusive() if recording else CUDA_WORK.shared():
            return self._run(columns, dtypes)

    def _run(self, columns: dict[str, Sequence[np.ndarray]], dtypes: dict[str, np.dtype]) -> list[np.ndarray]:
        batches = {name: self._batch(name, rows, dtypes[name]) for name, rows in columns.items()}
        if self.graph_rows and len(next(iter(batches.values()))) == self.graph_rows:
            if self.graph is None:
                self.graph = GraphRun(self.session, batches, self.output_names, self.device)
            if self.graph.signature == signature(batches):
                return self.graph.run(batches)
        for name, batch in batches.items():
            self.binding.bind_input(name, "cpu", 0, batch.dtype, list(batch.shape), batch.ctypes.data)
        for name in self.output_names:
            self.binding.bind_output(name, self.device)
        try:
            self.session.run_with_iobinding(self.binding, self.plain_options)
            return self.binding.copy_outputs_to_cpu()
        finally:
            self.binding.clear_binding_outputs()

    def _batch(self, name: str, rows: Sequence[np.ndarray], dtype: np.dtype) -> np.ndarray:
        """The rows as one contiguous batch in a page-locked buffer: the decoder's, where they lie
        there already, else the staging buffer with the rows copied (and cast) into it."""
        decoded = self.decoded.get(name)
        if decoded is not None and rows[0].dtype == dtype and decoded.holds(rows):
            return decoded.array[:len(rows)]
        batch = self.staging.setdefault(name, HostBuffer(self.device)).rows(len(rows), rows[0].shape, dtype)
        if self.copy_threads == 1 or batch.nbytes < PARALLEL_COPY_BYTES:
            return np.stack(rows, out=batch, casting="same_kind")
        step = -(-len(rows) // self.copy_threads)
        list(_copy_pool().map(lambda start: np.stack(rows[start:start + step], out=batch[start:start + step], casting="same_kind"),
                              range(0, len(rows), step)))
        return batch


@functools.cache
def _copy_pool() -> ThreadPoolExecutor:
    """Threads that copy a large batch's rows into place side by side (numpy lets go of the GIL
    while it copies): one thread's copy runs well under the memory bus's pace."""
    return ThreadPoolExecutor(COPY_THREADS, "copy")
