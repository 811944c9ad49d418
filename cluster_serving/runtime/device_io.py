"""How a batch reaches the device and its results come back, when the model runs on a GPU.

Each input's rows are written into one reused host buffer, page-locked on CUDA so that the copy
to the device is one DMA transfer, and bound to the session (I/O binding); outputs stay on the
device until the run ends and are copied back once per batch. Images are decoded straight into a
second such buffer (`decode_buffer`), which is then bound as it is. The CPU provider accepts bound
inputs too, which is how the tests cover this path on machines without a GPU.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnxruntime as ort

log = logging.getLogger(__name__)
# The CUDA runtime that ONNX Runtime's CUDA provider links: loaded already once a CUDA session opened.
CUDA_RUNTIME = "libcudart.so.13"
# Batches of this many bytes or more are copied into place by COPY_THREADS threads.
PARALLEL_COPY_BYTES = 4 << 20
COPY_THREADS = min(os.cpu_count() or 1, 8)


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


class BoundRunner:
    """Runs one session with I/O binding and reused host buffers, one per input."""

    def __init__(self, session: ort.InferenceSession, output_names: list[str], device: str):
        self.session = session
        self.output_names = output_names
        self.device = device  # where outputs are bound: "cuda" or "cpu"
        self.binding = session.io_binding()
        self.staging: dict[str, HostBuffer] = {}
        self.decoded: dict[str, HostBuffer] = {}

    def decode_buffer(self, name: str, count: int, row_shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """Where a batch's decoded images of input `name` go, so that the run binds them as they lie."""
        return self.decoded.setdefault(name, HostBuffer(self.device)).rows(count, row_shape, np.dtype(dtype))

    def run(self, columns: dict[str, Sequence[np.ndarray]], dtypes: dict[str, np.dtype]) -> list[np.ndarray]:
        """The outputs of one run over `columns` (an input's rows each), cast to `dtypes`."""
        for name, rows in columns.items():
            batch = self._batch(name, rows, dtypes[name])
            self.binding.bind_input(name, "cpu", 0, batch.dtype, list(batch.shape), batch.ctypes.data)
        for name in self.output_names:
            self.binding.bind_output(name, self.device)
        try:
            self.session.run_with_iobinding(self.binding)
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
        step = -(-len(rows) // COPY_THREADS) if batch.nbytes >= PARALLEL_COPY_BYTES else len(rows)
        list(_copy_pool().map(lambda start: np.stack(rows[start:start + step], out=batch[start:start + step], casting="same_kind"),
                              range(0, len(rows), step)))
        return batch


@functools.cache
def _copy_pool() -> ThreadPoolExecutor:
    """Threads that copy a large batch's rows into place side by side (numpy lets go of the GIL
    while it copies): one thread's copy runs well under the memory bus's pace."""
    return ThreadPoolExecutor(COPY_THREADS, "copy")
