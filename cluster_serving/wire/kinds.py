"""The kinds of input value, each one class holding all that its values need in every room, and
`KINDS`, the ordered registry that every room dispatches through: the client's Python forms
(cluster_serving/wire/inputs.py), the bridge's JSON forms (same), the version 1 column, both ways
(cluster_serving/wire/v1.py), and the array the model gets (cluster_serving/runtime/preprocess.py). A new kind is one
`Kind` subclass, registered in `KINDS`. (Over 300 lines on purpose: each kind's every step sits
together, which is what makes a new kind one place; split per kind, it would be four files to read.)

The four input types of BigDL Cluster Serving, by the value's form:
- tensor: an ndarray (or scalar, or nested list of numbers) of any allowed dtype and rank;
- string: a list of str (or a str array) -> a string tensor, which is a dense tensor of dtype
  "str" on the wire too, so `DenseKind` reads both;
- image: {"path": file} (read here) or {"b64": text} -> the encoded JPEG/PNG bytes, which the job
  decodes as its config says for that input;
- sparse tensor: [indices, values, shape] as in BigDL's API guide (indices of shape (rank, nnz)),
  or a `SparseTensor` (indices of shape (nnz, rank)).

In JSON (the bridge's `instances`) an image is {"b64": text}, or a bare string for an input the
config declares an image; a sparse tensor is {"shape", "data", "indices"} with one index row per
value; anything else is a dense tensor typed by the model's dtype for that input.
"""

from __future__ import annotations

import base64
import binascii
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa

from cluster_serving.wire.tensors import TensorError, dense_array
from cluster_serving.wire.values import (
    IMAGE_DTYPE,
    NUMERIC_DTYPES,
    STRING_DTYPE,
    DecodeError,
    EncodedImage,
    SparseTensor,
    TooLarge,
    Value,
    dtype_name,
    parse_shape,
)

SPARSE_LAYOUT = "coo"
ALLOWED_DTYPES = NUMERIC_DTYPES | {STRING_DTYPE}  # of dense tensors
# Each dtype's Arrow type, looked up once: pa.from_numpy_dtype is slow to call per value.
_ARROW_TYPES = {name: pa.from_numpy_dtype(np.dtype(name)) for name in NUMERIC_DTYPES} | {STRING_DTYPE: pa.large_string()}
# A sender checks a sparse tensor's consistency only; its dense size is the reader's limit.
NO_SIZE_LIMIT = 2**63

# name, encoded bytes -> the model's array: the job's Pillow decoder, bound to that input's
# ImageConfig and the pixel limit, handed in so that connectors/ import no job code.
ImageDecoder = Callable[[str, bytes], np.ndarray]
Metadata = Mapping[str, str]  # a version 1 column's field metadata


@dataclass(frozen=True)
class JsonHints:
    """What the bridge knows of an input besides its JSON value, which says neither its dtype nor
    whether a string is text or a base64 image."""

    dtype: np.dtype | None  # the model's; None for an input the model lacks (the job names it)
    image: bool  # the config declares the input an image


class Kind(ABC):
    """One kind of value, room by room. The registry asks each kind in order whether a value or a
    column is its own (`holds`, `takes`, `takes_json`, `reads_column`), and the first that says
    yes reads it; a kind refuses what it takes but cannot read, naming the input."""

    wire_type: ClassVar[type]  # the Python type of its wire values
    json_object: ClassVar[str | None] = None  # its JSON object form, as a refusal describes it

    def holds(self, value: object) -> bool:
        """Whether a wire value is of this kind."""
        return isinstance(value, self.wire_type)

    @abstractmethod
    def takes(self, value: Any) -> bool:
        """Whether a client's Python value is in one of this kind's forms."""

    @abstractmethod
    def from_client(self, name: str, value: Any) -> Value:
        """The wire value of a form it takes; TensorError if it is a bad one."""

    @abstractmethod
    def takes_json(self, value: Any, hints: JsonHints) -> bool:
        """Whether a JSON value is in one of this kind's forms."""

    @abstractmethod
    def from_json(self, name: str, value: Any, hints: JsonHints) -> Value:
        """The wire value of a JSON form it takes; TensorError if it is a bad one."""

    @abstractmethod
    def reads_column(self, metadata: Metadata) -> bool:
        """Whether a version 1 column with this field metadata is of this kind."""

    @abstractmethod
    def to_column(self, value: Value) -> tuple[pa.Array, dict[str, str]]:
        """The value's one-row version 1 column and its field metadata; ValueError if the format
        cannot carry it."""

    @abstractmethod
    def from_column(self, name: str, metadata: Metadata, column: pa.Array, max_bytes: int) -> Value:
        """The wire value a column holds, once checked (its type is one the format uses);
        DecodeError saying what is wrong otherwise."""

    @abstractmethod
    def to_array(self, name: str, value: Value, decode_image: ImageDecoder) -> np.ndarray:
        """The array the model gets."""


class ImageKind(Kind):
    """Encoded JPEG/PNG bytes: carried as they are, a fraction of the pixels' size, and decoded by
    the job as the input's config says, once the pixel count in the header is within its limit."""

    wire_type = EncodedImage
    json_object = "an image {'b64': '...'}"

    def takes(self, value: Any) -> bool:
        return isinstance(value, (EncodedImage, Mapping))

    def from_client(self, name: str, value: Any) -> Value:
        if isinstance(value, EncodedImage):
            return value
        if set(value) == {"path"}:
            try:
                return EncodedImage(Path(value["path"]).read_bytes())
            except OSError as exc:
                raise TensorError(f"input {name!r}: cannot read image {value['path']}: {exc.strerror}") from None
        if set(value) == {"b64"} and isinstance(value["b64"], (str, bytes)):
            return _b64_image(name, value["b64"])
        raise TensorError(f"input {name!r}: an image is {{'path': file}} or {{'b64': base64 text}}, got keys {sorted(value)}")

    def takes_json(self, value: Any, hints: JsonHints) -> bool:
        if isinstance(value, dict):
            return set(value) == {"b64"} and isinstance(value["b64"], str)
        return hints.image and isinstance(value, str)

    def from_json(self, name: str, value: Any, hints: JsonHints) -> Value:
        return _b64_image(name, value if isinstance(value, str) else value["b64"])

    def reads_column(self, metadata: Metadata) -> bool:
        return metadata.get("cs.dtype") == IMAGE_DTYPE

    def to_column(self, value: EncodedImage) -> tuple[pa.Array, dict[str, str]]:
        if not value.data:
            raise ValueError("empty image")
        return _one_row(pa.array([value.data], pa.large_binary())), {"cs.dtype": IMAGE_DTYPE, "cs.shape": "[]"}

    def from_column(self, name: str, metadata: Metadata, column: pa.Array, max_bytes: int) -> Value:
        if column.type != pa.large_list(pa.large_binary()):
            raise DecodeError(f"image {name!r}: must be a large_list<large_binary> column")
        values = column.flatten()
        if len(values) != 1 or values.null_count or not values[0].as_py():
            raise DecodeError(f"image {name!r}: must hold exactly one non-empty encoded image")
        return EncodedImage(values[0].as_py())

    def to_array(self, name: str, value: EncodedImage, decode_image: ImageDecoder) -> np.ndarray:
        return decode_image(name, value.data)


def _b64_image(name: str, text: str | bytes) -> EncodedImage:
    try:
        return EncodedImage(base64.b64decode(text, validate=True))
    except binascii.Error:
        raise TensorError(f"input {name!r}: 'b64' is not valid base64") from None


class SparseKind(Kind):
    """COO sparse tensors: carried as indices and values, a few bytes for what may be a huge dense
    tensor, so a reader checks every index against the shape and the dense size against its
    limit before the job densifies it."""

    wire_type = SparseTensor
    json_object = "a sparse tensor {'shape': [...], 'data': [...], 'indices': [[...], ...]}"

    def takes(self, value: Any) -> bool:
        return isinstance(value, SparseTensor) or (
            isinstance(value, (list, tuple)) and len(value) == 3 and all(isinstance(part, np.ndarray) for part in value)
        )

    def from_client(self, name: str, value: Any) -> Value:
        """A SparseTensor as it is (the encoder checks it), or BigDL's [indices, values, shape],
        where indices[d] holds dimension d's index of every value."""
        if isinstance(value, SparseTensor):
            return value
        indices, values, shape = value
        if indices.ndim != 2 or values.ndim != 1 or shape.ndim != 1 or indices.dtype.kind not in "iu":
            raise TensorError(
                f"input {name!r}: a sparse tensor is [indices (2-D ints, one row per dimension), "
                "values (1-D), shape (1-D)]"
            )
        sparse = SparseTensor(np.ascontiguousarray(indices.T, np.int64), values, tuple(int(dim) for dim in shape))
        try:
            sparse.check(max_dense_bytes=NO_SIZE_LIMIT)
        except ValueError as exc:
            raise TensorError(f"input {name!r}: {exc}") from None
        return sparse

    def takes_json(self, value: Any, hints: JsonHints) -> bool:
        return isinstance(value, dict) and {"shape", "data", "indices"} <= set(value)

    def from_json(self, name: str, value: Any, hints: JsonHints) -> Value:
        """{'shape', 'data', 'indices'} as in the programming guide: one index row per value."""
        shape = dense_array(f"{name}.shape", value["shape"], np.dtype("int64"), from_json=True)
        values = dense_array(f"{name}.data", value["data"], hints.dtype, from_json=True)
        indices = dense_array(f"{name}.indices", value["indices"], np.dtype("int64"), from_json=True)
        if shape.ndim != 1 or values.ndim != 1:
            raise TensorError(f"input {name!r}: sparse 'shape' and 'data' must be flat lists")
        if indices.size == 0:
            indices = indices.reshape(0, len(shape))
        if indices.ndim != 2 or indices.shape != (len(values), len(shape)):
            raise TensorError(
                f"input {name!r}: sparse 'indices' must hold one list of {len(shape)} indices per value"
            )
        return SparseTensor(indices=indices, values=values, shape=tuple(int(dim) for dim in shape))

    def reads_column(self, metadata: Metadata) -> bool:
        return metadata.get("cs.layout") == SPARSE_LAYOUT

    def to_column(self, value: SparseTensor) -> tuple[pa.Array, dict[str, str]]:
        kind = dtype_name(value.values)
        if kind not in NUMERIC_DTYPES:
            raise ValueError(f"sparse values must be numbers, got dtype {value.values.dtype}")
        value.check(max_dense_bytes=NO_SIZE_LIMIT)
        parts = [_tensor_column(np.asarray(value.indices, np.int64), "int64"), _tensor_column(value.values, kind)]
        column = pa.StructArray.from_arrays(parts, names=["indices", "values"])
        return column, {"cs.dtype": kind, "cs.shape": _json_shape(value.shape), "cs.layout": SPARSE_LAYOUT}

    def from_column(self, name: str, metadata: Metadata, column: pa.Array, max_bytes: int) -> Value:
        kind, shape = _tensor_header(name, metadata)
        if kind not in NUMERIC_DTYPES:
            raise DecodeError(f"sparse tensor {name!r}: dtype {kind!r} is not a number type")
        if not pa.types.is_struct(column.type) or [f.name for f in column.type] != ["indices", "values"]:
            raise DecodeError(f"sparse tensor {name!r}: must be a struct of indices and values")
        indices_column, values_column = column.flatten()
        indices = _decode_tensor(f"{name}.indices", "int64", None, indices_column)
        values = _decode_tensor(f"{name}.values", kind, None, values_column)
        if len(values) * len(shape) != len(indices):
            raise DecodeError(f"sparse tensor {name!r}: {len(indices)} indices for {len(values)} values of rank {len(shape)}")
        sparse = SparseTensor(indices.reshape(len(values), len(shape)), values, shape)
        try:
            sparse.check(max_dense_bytes=max_bytes)
        except TooLarge as exc:
            raise TooLarge(f"sparse tensor {name!r}: {exc}") from None
        except ValueError as exc:
            raise DecodeError(f"sparse tensor {name!r}: {exc}") from None
        return sparse

    def to_array(self, name: str, value: SparseTensor, decode_image: ImageDecoder) -> np.ndarray:
        return value.to_dense()  # from_column checked its bounds and dense size


class DenseKind(Kind):
    """Dense tensors, strings included: a string tensor differs only in its values' type, so it is
    read, carried and handed to the model as any other. Last in the registry, it takes whatever
    no other kind does, as np.asarray reads it."""

    wire_type = np.ndarray

    def holds(self, value: object) -> bool:
        return True

    def takes(self, value: Any) -> bool:
        return True

    def from_client(self, name: str, value: Any) -> Value:
        return dense_array(name, value)

    def takes_json(self, value: Any, hints: JsonHints) -> bool:
        return not isinstance(value, dict)  # a JSON object is another kind's form or none

    def from_json(self, name: str, value: Any, hints: JsonHints) -> Value:
        return dense_array(name, value, hints.dtype, from_json=True)

    def reads_column(self, metadata: Metadata) -> bool:
        return True  # so a layout that no kind knows is refused by name, in from_column

    def to_column(self, value: Any) -> tuple[pa.Array, dict[str, str]]:
        array = np.asarray(value)
        kind = dtype_name(array)
        if kind not in ALLOWED_DTYPES:
            raise ValueError(f"dtype {array.dtype} is not supported")
        return _tensor_column(array, kind), {"cs.dtype": kind, "cs.shape": _json_shape(array.shape)}

    def from_column(self, name: str, metadata: Metadata, column: pa.Array, max_bytes: int) -> Value:
        kind, shape = _tensor_header(name, metadata)
        layout = metadata.get("cs.layout")
        if layout is not None:
            raise DecodeError(f"tensor {name!r}: unknown layout {layout!r}")
        return _decode_tensor(name, kind, shape, column)

    def to_array(self, name: str, value: np.ndarray, decode_image: ImageDecoder) -> np.ndarray:
        return value


# The first kind that holds, takes or reads a value is its kind: forms overlap (a dense tensor
# takes anything), so the most particular come first.
KINDS: tuple[Kind, ...] = (ImageKind(), SparseKind(), DenseKind())
_BY_WIRE_TYPE = {kind.wire_type: kind for kind in KINDS}


def kind_of(value: Value) -> Kind:
    """The kind of a wire value: by its exact type first, a dict lookup, since the encoder and
    the job ask this of every value."""
    return _BY_WIRE_TYPE.get(type(value)) or next(kind for kind in KINDS if kind.holds(value))


def _tensor_header(name: str, metadata: Metadata) -> tuple[str, tuple[int, ...]]:
    """A tensor column's dtype and shape, checked alike for dense and sparse tensors."""
    kind = metadata.get("cs.dtype")
    if kind not in ALLOWED_DTYPES:
        raise DecodeError(f"tensor {name!r}: dtype {kind!r} is not allowed")
    return kind, parse_shape(name, metadata.get("cs.shape"))


def _json_shape(shape: tuple[int, ...]) -> str:
    return "[" + ",".join(str(int(dim)) for dim in shape) + "]"  # a JSON list, written fast


def _one_row(values: pa.Array) -> pa.Array:
    offsets = pa.py_buffer(np.array([0, len(values)], dtype=np.int64))
    return pa.Array.from_buffers(pa.large_list(values.type), 1, [None, offsets], children=[values])


def _tensor_column(array: np.ndarray, kind: str) -> pa.Array:
    """A one-row large_list column holding the tensor's values in C order."""
    if kind == STRING_DTYPE:
        values = pa.array([str(item) for item in array.ravel()], pa.large_string())
    elif kind == "bool":
        values = pa.array(array.ravel())  # Arrow packs booleans into bits
    else:
        # Numeric values are wrapped, not converted (pa.array() copies and checks each value).
        flat = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("=")).reshape(-1)
        values = pa.Array.from_buffers(_ARROW_TYPES[kind], flat.size, [None, pa.py_buffer(flat)])
    return _one_row(values)


def _decode_tensor(name: str, kind: str, shape: tuple[int, ...] | None, column: pa.Array) -> np.ndarray:
    """A dense tensor; `shape` None: a flat one of whatever length the column holds."""
    if not pa.types.is_large_list(column.type):
        raise DecodeError(f"tensor {name!r}: values must be a large_list column")
    values = column.flatten()  # the row's values, honouring the list offsets
    if shape is None:
        shape = (len(values),)
    if values.type != _ARROW_TYPES[kind]:
        raise DecodeError(f"tensor {name!r}: values of type {values.type} do not match dtype {kind}")
    if len(values) != math.prod(shape):
        raise DecodeError(f"tensor {name!r}: {len(values)} values do not fill shape {shape}")
    if values.null_count:
        raise DecodeError(f"tensor {name!r}: null values")
    if kind == STRING_DTYPE:
        return np.array(values.to_pylist(), dtype=object).reshape(shape)
    if kind == "bool":
        return values.to_numpy(zero_copy_only=False).reshape(shape)
    dtype = np.dtype(kind)
    if len(values) == 0:
        return np.empty(shape, dtype=dtype)
    # A view of the message's buffer (validated above), no copy as to_numpy() makes.
    data = values.buffers()[1]
    return np.frombuffer(data, dtype=dtype, count=len(values), offset=values.offset * dtype.itemsize).reshape(shape)
