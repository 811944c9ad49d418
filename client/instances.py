"""What users pass to `enqueue` -> the wire values of one request.

The four input types of BigDL Cluster Serving's client, by the value's form:
- string: a list of str (or a str array) -> a string tensor;
- image: {"path": file} (read here) or {"b64": text} -> the encoded JPEG/PNG bytes, which the job
  decodes as its config says for that input;
- tensor: an ndarray (or scalar, or nested list of numbers) of any allowed dtype and rank;
- sparse tensor: [indices, values, shape] as in BigDL's API guide (indices of shape (rank, nnz)),
  or a `SparseTensor` (indices of shape (nnz, rank)).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from connectors.codec import EncodedImage, Message, SparseTensor, Value, encode_message


def encode_request(uri: str, data: Mapping[str, Any]) -> bytes:
    """The request's bytes; a value of no known form raises ValueError naming its input."""
    if not isinstance(uri, str) or not uri:
        raise ValueError("uri must be a non-empty string")
    if not data:
        raise ValueError("a request needs at least one named input, e.g. enqueue(uri, x=array)")
    return encode_message(Message(uri, {name: wire_value(name, value) for name, value in data.items()}))


def wire_value(name: str, value: Any) -> Value:
    if isinstance(value, (SparseTensor, EncodedImage)):
        return value
    if isinstance(value, Mapping):
        return _image(name, value)
    if isinstance(value, (list, tuple)) and len(value) == 3 and all(isinstance(part, np.ndarray) for part in value):
        return _sparse(name, *value)
    return _dense(name, value)


def _image(name: str, value: Mapping[str, Any]) -> EncodedImage:
    if set(value) == {"path"}:
        try:
            return EncodedImage(Path(value["path"]).read_bytes())
        except OSError as exc:
            raise ValueError(f"input {name!r}: cannot read image {value['path']}: {exc.strerror}") from None
    if set(value) == {"b64"} and isinstance(value["b64"], (str, bytes)):
        try:
            return EncodedImage(base64.b64decode(value["b64"], validate=True))
        except binascii.Error:
            raise ValueError(f"input {name!r}: 'b64' is not valid base64") from None
    raise ValueError(f"input {name!r}: an image is {{'path': file}} or {{'b64': base64 text}}, got keys {sorted(value)}")


def _sparse(name: str, indices: np.ndarray, values: np.ndarray, shape: np.ndarray) -> SparseTensor:
    """BigDL's form: indices[d] holds dimension d's index of every value."""
    if indices.ndim != 2 or values.ndim != 1 or shape.ndim != 1 or indices.dtype.kind not in "iu":
        raise ValueError(
            f"input {name!r}: a sparse tensor is [indices (2-D ints, one row per dimension), "
            "values (1-D), shape (1-D)]"
        )
    sparse = SparseTensor(np.ascontiguousarray(indices.T, np.int64), values, tuple(int(dim) for dim in shape))
    try:
        sparse.check(max_dense_bytes=2**63)
    except ValueError as exc:
        raise ValueError(f"input {name!r}: {exc}") from None
    return sparse


def _dense(name: str, value: Any) -> np.ndarray:
    try:
        array = np.asarray(value)
    except ValueError:
        raise ValueError(f"input {name!r}: nested lists must be rectangular") from None
    if array.dtype.kind == "U" and not isinstance(value, np.ndarray):
        # numpy turns [1, "a"] into strings; only lists of str are string tensors
        if not all(isinstance(item, str) for item in np.asarray(value, dtype=object).reshape(-1)):
            raise ValueError(f"input {name!r}: a list mixes strings and other values")
    if array.dtype.kind == "O" and not all(isinstance(item, str) for item in array.reshape(-1)):
        raise ValueError(f"input {name!r}: values must be numbers, booleans or strings, got {array.dtype}")
    return array
