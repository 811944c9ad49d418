"""Tensors as every room names them: one dtype table (numpy, ONNX, the open inference protocol),
one description of a model's tensors with the rule for when instances stack into one run, and the
one conversion of user values (numbers, nested lists, strings) into arrays.

The job reads tensors from ONNX Runtime, the bridge from the ONNX file and JSON, the client from
Python values; they must agree on every name and rule, so each is written here once.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

# numpy dtype name -> (the ONNX type as ONNX Runtime and onnx print it, the v2 protocol's datatype).
# Strings are numpy object arrays of str.
_DTYPES: dict[str, tuple[str, str]] = {
    "bool": ("tensor(bool)", "BOOL"),
    "uint8": ("tensor(uint8)", "UINT8"),
    "uint16": ("tensor(uint16)", "UINT16"),
    "uint32": ("tensor(uint32)", "UINT32"),
    "uint64": ("tensor(uint64)", "UINT64"),
    "int8": ("tensor(int8)", "INT8"),
    "int16": ("tensor(int16)", "INT16"),
    "int32": ("tensor(int32)", "INT32"),
    "int64": ("tensor(int64)", "INT64"),
    "float16": ("tensor(float16)", "FP16"),
    "float32": ("tensor(float)", "FP32"),
    "float64": ("tensor(double)", "FP64"),
    "object": ("tensor(string)", "BYTES"),
}
ONNX_DTYPES: dict[str, np.dtype] = {onnx: np.dtype(name) for name, (onnx, _) in _DTYPES.items()}
V2_DATATYPES: dict[str, str] = {name: v2 for name, (_, v2) in _DTYPES.items()}
V2_NUMPY_DTYPES: dict[str, np.dtype] = {v2: np.dtype(name) for name, (_, v2) in _DTYPES.items()}
# The same keyed by the dtype itself: dtype.name is computed in Python, slowly, and v2_datatype
# runs per output of every answer.
_V2_BY_DTYPE: dict[np.dtype, str] = {np.dtype(name): v2 for name, (_, v2) in _DTYPES.items()}


class TensorError(ValueError):
    """A value that is not a tensor the model can take; the message names the input."""


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a model."""

    name: str
    dtype: np.dtype  # object for strings
    shape: tuple[int | None, ...]  # None: symbolic or unknown

    @property
    def has_batch_dim(self) -> bool:
        return len(self.shape) > 0 and self.shape[0] is None

    @property
    def datatype(self) -> str:
        """The open inference protocol's name of the dtype."""
        return V2_DATATYPES[self.dtype.name]


def onnx_spec(name: str, onnx_type: str, dims: list[Any]) -> TensorSpec:
    """A model tensor from its ONNX type string and dimensions (ints, or names and None for free
    ones); a type outside the table raises TensorError."""
    if onnx_type not in ONNX_DTYPES:
        raise TensorError(f"tensor {name!r} has unsupported type {onnx_type}")
    shape = tuple(dim if isinstance(dim, int) and dim >= 0 else None for dim in dims)
    return TensorSpec(name, ONNX_DTYPES[onnx_type], shape)


def config_mismatch(
    inputs: list[str], outputs: list[str], configured_inputs: tuple[str, ...] = (),
    configured_outputs: tuple[str, ...] = (), image_inputs: tuple[str, ...] = (),
) -> str | None:
    """Why a model with these input and output names does not fit `model.inputs`, `model.outputs`
    and `preprocess.images`, or None: the job and the bridge refuse a model alike, in these words."""
    if configured_inputs and set(configured_inputs) != set(inputs):
        return f"model.inputs {list(configured_inputs)} do not match the model's inputs {inputs}"
    missing = sorted(set(configured_outputs) - set(outputs))
    if missing:
        return f"model.outputs: the model has no output {missing[0]!r}; it has {outputs}"
    strangers = [name for name in image_inputs if name not in inputs]
    if strangers:
        return f"preprocess.images.{strangers[0]}: the model has no input {strangers[0]!r}; it has {inputs}"
    return None


def stacks(inputs: tuple[TensorSpec, ...] | list[TensorSpec]) -> bool:
    """Instances are stacked into one run only when every input has a free leading dimension;
    otherwise each instance is a whole input and runs alone."""
    return bool(inputs) and all(spec.has_batch_dim for spec in inputs)


def dense_array(name: str, value: Any, dtype: np.dtype | None = None, from_json: bool = False) -> np.ndarray:
    """A scalar, nested list or array as an array of `dtype` (None: numpy's own guess).

    A value that would change meaning on the way is refused: a fraction for an integer input, a
    number out of the dtype's range, numbers for a string input, a list mixing strings and
    numbers. `from_json`: strict JSON has no NaN or infinities, so a non-finite float there is a
    number that overflowed (1e39 in float32, 1e999) and is refused too."""
    try:
        array = np.asarray(value)
    except ValueError:
        raise TensorError(f"input {name!r}: nested lists must be rectangular") from None
    if array.dtype.kind in "UO" and not _all_strings(value, array):
        if array.dtype.kind == "U":  # numpy turns [1, "a"] into strings
            raise TensorError(f"input {name!r}: a list mixes strings and other values")
        raise TensorError(f"input {name!r}: values must be all numbers, all booleans or all strings")
    if array.dtype.kind in "UO":
        if dtype is not None and dtype.kind != "O":
            raise TensorError(f"input {name!r}: expects {dtype.name} numbers, got strings")
        return array
    if dtype is None:
        typed = array
    elif dtype.kind in "iu" and array.dtype.kind == "f" and not isinstance(value, np.ndarray):
        typed = _whole_numbers(name, value, array, dtype)
    elif array.size == 0 and dtype.kind != "O":
        typed = array.astype(dtype)  # an empty list has no values to check
    else:
        typed = _typed(name, array, dtype)
    if from_json and typed.dtype.kind == "f" and not np.isfinite(typed).all():
        raise TensorError(f"input {name!r}: values outside the range of {typed.dtype.name}")
    return typed


def _whole_numbers(name: str, value: Any, array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Python ints that numpy read as float64 (one past int64's range: uint64's top half) made
    `dtype` exactly, not through a float that rounds them; anything else as _typed takes it."""
    items = np.asarray(value, dtype=object).reshape(-1)
    if not all(type(item) is int for item in items):
        return _typed(name, array, dtype)
    limits = np.iinfo(dtype)
    if not all(limits.min <= item <= limits.max for item in items):
        raise TensorError(f"input {name!r}: values outside the range of {dtype.name}")
    return np.array(items.tolist(), dtype=dtype).reshape(array.shape)


def _all_strings(value: Any, array: np.ndarray) -> bool:
    if isinstance(value, np.ndarray) and value.dtype.kind == "U":
        return True
    return all(isinstance(item, str) for item in np.asarray(value, dtype=object).reshape(-1))


def _typed(name: str, array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    got = array.dtype.kind
    if dtype.kind == "O":
        raise TensorError(f"input {name!r}: expects strings, got {array.dtype.name} values")
    if (got == "b") != (dtype.kind == "b"):
        raise TensorError(f"input {name!r}: expects {dtype.name}, got {'booleans' if got == 'b' else 'numbers'}")
    if got == "f" and dtype.kind in "iu" and (array != np.round(array)).any():
        raise TensorError(f"input {name!r}: expects {dtype.name}, got fractional values")
    if dtype.kind in "iu" and cast_changes_values(array, dtype):
        raise TensorError(f"input {name!r}: values outside the range of {dtype.name}")
    with np.errstate(over="ignore"):  # a float overflow becomes inf, which the caller refuses from JSON
        return array.astype(dtype)


def cast_changes_values(array: np.ndarray, dtype: np.dtype) -> bool:
    """Whether casting `array` to `dtype` would change a value: a number outside an integer dtype's
    range (it would wrap), or a finite float that a narrower float dtype makes infinite."""
    if array.size == 0 or array.dtype == dtype:
        return False
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return bool(array.min() < info.min or array.max() > info.max)
    if dtype.kind == "f" and array.dtype.kind == "f" and array.dtype.itemsize > dtype.itemsize:
        with np.errstate(over="ignore"):
            return bool((np.isfinite(array.astype(dtype)) != np.isfinite(array)).any())
    return False


# The open inference protocol's raw tensor layout (KServe's binary tensor extension over HTTP, the
# protobuf raw contents): values little-endian and row-major, BOOL one byte each (0 or 1), BYTES
# each a 4-byte little-endian length and that many bytes (UTF-8 text: string tensors hold str).
RAW_LENGTH = struct.Struct("<I")


def raw_values(name: str, dtype: np.dtype, chunk: bytes) -> np.ndarray:
    """One input's values from the raw layout, flat (the caller checks them against the shape);
    TensorError for bytes that are not values of `dtype`."""
    if dtype.kind == "O":
        return _raw_strings(name, chunk)
    if chunk and len(chunk) % dtype.itemsize:
        raise TensorError(f"input {name!r}: {len(chunk)} bytes are not a whole number of {V2_DATATYPES[dtype.name]} values")
    if dtype.kind == "b":
        raw = np.frombuffer(chunk, np.uint8)
        if raw.size and raw.max() > 1:
            raise TensorError(f"input {name!r}: a BOOL value is one byte, 0 or 1")
        return raw.view(bool)
    return np.frombuffer(chunk, dtype.newbyteorder("<"))


def _raw_strings(name: str, chunk: bytes) -> np.ndarray:
    values, at = [], 0
    while at < len(chunk):
        if at + RAW_LENGTH.size > len(chunk):
            raise TensorError(f"input {name!r}: BYTES data end inside a length prefix")
        (length,) = RAW_LENGTH.unpack_from(chunk, at)
        at += RAW_LENGTH.size
        if at + length > len(chunk):
            raise TensorError(f"input {name!r}: a BYTES value of {length} bytes runs past the data")
        try:
            values.append(chunk[at: at + length].decode())
        except UnicodeDecodeError:
            raise TensorError(f"input {name!r}: BYTES values must be UTF-8 text") from None
        at += length
    return np.array(values, dtype=object)


def raw_bytes(array: np.ndarray) -> bytes:
    """An array's values in the raw layout (strings each behind their length; str() of each, not
    numpy's astype(str), which drops trailing NULs)."""
    if array.dtype.kind in "OU":
        texts = [str(value).encode() for value in array.reshape(-1).tolist()]
        return b"".join(RAW_LENGTH.pack(len(text)) + text for text in texts)
    return np.ascontiguousarray(array, array.dtype.newbyteorder("<")).tobytes()


def v2_datatype(array: np.ndarray) -> str:
    """The open inference protocol's datatype of an array; strings (and anything else) BYTES."""
    return _V2_BY_DTYPE.get(array.dtype) or V2_DATATYPES.get(array.dtype.name, "BYTES")


def json_values(array: np.ndarray) -> Any:
    """An array as nested JSON lists; NaN and infinities (not JSON) become null; strings each
    str() (not numpy's astype(str), which drops trailing NULs)."""
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        return np.where(np.isfinite(array), array.astype(object), None).tolist()
    if array.dtype.kind in "OU":
        return np.asarray(np.frompyfunc(str, 1, 1)(array), dtype=object).tolist()
    return array.tolist()
