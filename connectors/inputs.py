"""The forms users write a request's inputs in, read into wire values, and a result as users see it.

One place for every form, so the client library (`enqueue`) and the HTTP bridge (JSON instances)
read them alike. The four input types of BigDL Cluster Serving, by the value's form:
- string: a list of str (or a str array) -> a string tensor;
- image: {"path": file} (read here) or {"b64": text} -> the encoded JPEG/PNG bytes, which the job
  decodes as its config says for that input;
- tensor: an ndarray (or scalar, or nested list of numbers) of any allowed dtype and rank;
- sparse tensor: [indices, values, shape] as in BigDL's API guide (indices of shape (rank, nnz)),
  or a `SparseTensor` (indices of shape (nnz, rank)).

In JSON (the bridge's `instances`) an image is {"b64": text}, or a bare string for an input the
config declares an image; a sparse tensor is {"shape", "data", "indices"} with one index row per
value; anything else is a dense tensor typed by the model's dtype for that input.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from connectors.codec import TOP_N_CLASSES, TOP_N_PROBABILITIES, EncodedImage, Message, SparseTensor, Value, encode_message
from connectors.tensors import TensorError, dense_array

# A result as users see it: output name -> ndarray, {class: probability} (top-N) or {'error': ...}.
Result = dict[Any, Any]


def encode_request(uri: str, data: Mapping[str, Any]) -> bytes:
    """The request's bytes; a value of no known form raises TensorError (a ValueError) naming its input."""
    if not isinstance(uri, str) or not uri:
        raise TensorError("uri must be a non-empty string")
    if not data:
        raise TensorError("a request needs at least one named input, e.g. enqueue(uri, x=array)")
    return encode_message(Message(uri, {name: wire_value(name, value) for name, value in data.items()}))


def wire_value(name: str, value: Any) -> Value:
    if isinstance(value, (SparseTensor, EncodedImage)):
        return value
    if isinstance(value, Mapping):
        return _image(name, value)
    if isinstance(value, (list, tuple)) and len(value) == 3 and all(isinstance(part, np.ndarray) for part in value):
        return _sparse(name, *value)
    return dense_array(name, value)


def _image(name: str, value: Mapping[str, Any]) -> EncodedImage:
    if set(value) == {"path"}:
        try:
            return EncodedImage(Path(value["path"]).read_bytes())
        except OSError as exc:
            raise TensorError(f"input {name!r}: cannot read image {value['path']}: {exc.strerror}") from None
    if set(value) == {"b64"} and isinstance(value["b64"], (str, bytes)):
        try:
            return EncodedImage(base64.b64decode(value["b64"], validate=True))
        except binascii.Error:
            raise TensorError(f"input {name!r}: 'b64' is not valid base64") from None
    raise TensorError(f"input {name!r}: an image is {{'path': file}} or {{'b64': base64 text}}, got keys {sorted(value)}")


def _sparse(name: str, indices: np.ndarray, values: np.ndarray, shape: np.ndarray) -> SparseTensor:
    """BigDL's form: indices[d] holds dimension d's index of every value."""
    if indices.ndim != 2 or values.ndim != 1 or shape.ndim != 1 or indices.dtype.kind not in "iu":
        raise TensorError(
            f"input {name!r}: a sparse tensor is [indices (2-D ints, one row per dimension), "
            "values (1-D), shape (1-D)]"
        )
    sparse = SparseTensor(np.ascontiguousarray(indices.T, np.int64), values, tuple(int(dim) for dim in shape))
    try:
        sparse.check(max_dense_bytes=2**63)
    except ValueError as exc:
        raise TensorError(f"input {name!r}: {exc}") from None
    return sparse


def json_inputs(
    instance: Any, dtype_of: Callable[[str], np.dtype | None], image_inputs: frozenset[str]
) -> dict[str, Value]:
    """One JSON instance -> its wire values; `dtype_of(name)` is the model's dtype for that input
    (None for one the model lacks: the job names it). Raises TensorError saying what is wrong."""
    if not isinstance(instance, dict) or not instance:
        raise TensorError("an instance must be a non-empty JSON object of input name -> value")
    return {name: _json_input(name, value, dtype_of(name), image_inputs) for name, value in instance.items()}


def _json_input(name: str, value: Any, dtype: np.dtype | None, image_inputs: frozenset[str]) -> Value:
    if isinstance(value, dict):
        if set(value) == {"b64"} and isinstance(value["b64"], str):
            return _image(name, value)
        if {"shape", "data", "indices"} <= set(value):
            return _json_sparse(name, value, dtype)
        raise TensorError(
            f"input {name!r}: an object must be an image {{'b64': '...'}} or a sparse tensor "
            "{'shape': [...], 'data': [...], 'indices': [[...], ...]}"
        )
    if name in image_inputs and isinstance(value, str):
        return _image(name, {"b64": value})
    return dense_array(name, value, dtype, from_json=True)


def _json_sparse(name: str, value: dict, dtype: np.dtype | None) -> SparseTensor:
    """{'shape', 'data', 'indices'} as in the programming guide: one index row per value."""
    shape = dense_array(f"{name}.shape", value["shape"], np.dtype("int64"), from_json=True)
    values = dense_array(f"{name}.data", value["data"], dtype, from_json=True)
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


def result_of(message: Message) -> Result:
    """A result as users see it: output name -> ndarray; with top_n, {class index: probability}
    best first; or {'error': message}."""
    if message.error is not None:
        return {"error": message.error}
    if message.top_n is not None:
        classes, probabilities = message.tensors.get(TOP_N_CLASSES), message.tensors.get(TOP_N_PROBABILITIES)
        if classes is None or probabilities is None:
            return {"error": "unreadable result: a top-N result without classes and probabilities"}
        return {int(cls): float(prob) for cls, prob in zip(classes, probabilities)}
    return dict(message.tensors)
