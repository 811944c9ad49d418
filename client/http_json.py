"""JSON <-> tensors for the HTTP bridge: the BigDL/KServe v1 `instances` forms and the KServe v2
(open inference protocol) tensors, both ways.

JSON numbers carry no dtype, so dense values are typed from the model's signature; a value that
would change meaning on the way (a fraction for an integer input, an integer out of range, a
number for a string input) is refused instead of silently converted.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from client.model_info import NUMPY_DTYPES, V2_DATATYPES, ModelSignature
from client.queues import result_of
from connectors.codec import Message, SparseTensor


class RequestError(ValueError):
    """A request the bridge refuses; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def instance_inputs(instance: Any, signature: ModelSignature, image_inputs: frozenset[str]) -> dict[str, Any]:
    """One `instances` entry -> the inputs `encode_request` takes (ndarray, {'b64'}, SparseTensor)."""
    if not isinstance(instance, dict) or not instance:
        raise RequestError("an instance must be a non-empty JSON object of input name -> value")
    return {name: _instance_input(name, value, signature, image_inputs) for name, value in instance.items()}


def _instance_input(name: str, value: Any, signature: ModelSignature, image_inputs: frozenset[str]) -> Any:
    info = signature.input(name)
    dtype = info.dtype if info else None
    if isinstance(value, dict):
        if set(value) == {"b64"} and isinstance(value["b64"], str):
            return {"b64": value["b64"]}
        if {"shape", "data", "indices"} <= set(value):
            return sparse_tensor(name, value, dtype)
        raise RequestError(
            f"input {name!r}: an object must be an image {{'b64': '...'}} or a sparse tensor "
            "{'shape': [...], 'data': [...], 'indices': [[...], ...]}"
        )
    if name in image_inputs and isinstance(value, str):
        return {"b64": value}
    return dense_array(name, value, dtype)


def sparse_tensor(name: str, value: dict, dtype: np.dtype | None) -> SparseTensor:
    """{'shape', 'data', 'indices'} as in the programming guide: one index row per value."""
    shape = dense_array(f"{name}.shape", value["shape"], np.dtype("int64"))
    values = dense_array(f"{name}.data", value["data"], dtype)
    indices = dense_array(f"{name}.indices", value["indices"], np.dtype("int64"))
    if shape.ndim != 1 or values.ndim != 1:
        raise RequestError(f"input {name!r}: sparse 'shape' and 'data' must be flat lists")
    if indices.size == 0:
        indices = indices.reshape(0, len(shape))
    if indices.ndim != 2 or indices.shape != (len(values), len(shape)):
        raise RequestError(
            f"input {name!r}: sparse 'indices' must hold one list of {len(shape)} indices per value"
        )
    return SparseTensor(indices=indices, values=values, shape=tuple(int(dim) for dim in shape))


def dense_array(name: str, value: Any, dtype: np.dtype | None) -> np.ndarray:
    """A JSON scalar or nested list as an array of `dtype` (None: numpy's own guess)."""
    try:
        array = np.asarray(value)
    except ValueError:
        raise RequestError(f"input {name!r}: nested lists must be rectangular") from None
    if array.dtype.kind == "U":
        if dtype is not None and dtype.kind != "O":
            raise RequestError(f"input {name!r}: expects {dtype.name} numbers, got strings")
        return array
    if array.dtype.kind == "O":
        raise RequestError(f"input {name!r}: values must be all numbers, all booleans or all strings")
    if dtype is None or array.size == 0 and dtype.kind != "O":
        return array if dtype is None else array.astype(dtype)
    return _typed(name, array, dtype)


def _typed(name: str, array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    got = array.dtype.kind
    if dtype.kind == "O":
        raise RequestError(f"input {name!r}: expects strings, got {array.dtype.name} values")
    if (got == "b") != (dtype.kind == "b"):
        raise RequestError(f"input {name!r}: expects {dtype.name}, got {'booleans' if got == 'b' else 'numbers'}")
    if got == "f" and dtype.kind in "iu":
        if not np.all(np.isfinite(array)) or np.any(array != np.round(array)):
            raise RequestError(f"input {name!r}: expects {dtype.name}, got fractional values")
    if dtype.kind in "iu" and array.size:
        info = np.iinfo(dtype)
        if array.min() < info.min or array.max() > info.max:
            raise RequestError(f"input {name!r}: values outside the range of {dtype.name}")
    return array.astype(dtype)


def v2_instances(inputs: list[dict], signature: ModelSignature) -> list[dict[str, np.ndarray]]:
    """KServe v2 `inputs` -> one instance per row of the batch dimension (a single instance when
    the model takes no batch dimension, as the job then runs instances one by one)."""
    tensors: dict[str, np.ndarray] = {}
    for tensor in inputs:
        name, shape, datatype = tensor["name"], tuple(tensor["shape"]), tensor["datatype"]
        if datatype not in NUMPY_DTYPES:
            raise RequestError(f"input {name!r}: unknown datatype {datatype!r} (known: {', '.join(NUMPY_DTYPES)})")
        if name in tensors:
            raise RequestError(f"input {name!r} given twice")
        array = dense_array(name, tensor["data"], NUMPY_DTYPES[datatype])
        if array.size != math.prod(shape):
            raise RequestError(f"input {name!r}: {array.size} values do not fill shape {list(shape)}")
        tensors[name] = array.reshape(shape)
    if not signature.batched:
        return [tensors]
    rows = {array.shape[0] if array.ndim else None for array in tensors.values()}
    if len(rows) != 1 or None in rows:
        raise RequestError("every input needs the same leading batch dimension")
    count = rows.pop()
    return [{name: array[i] for name, array in tensors.items()} for i in range(count)]


def json_values(array: np.ndarray) -> Any:
    """An array as nested JSON lists; NaN and infinities (not JSON) become null."""
    if array.dtype.kind == "f" and not np.all(np.isfinite(array)):
        return np.where(np.isfinite(array), array.astype(object), None).tolist()
    if array.dtype.kind in "OU":
        return array.astype(str).tolist()
    return array.tolist()


def prediction(result: Message) -> Any:
    """One result as a v1 prediction: the output's values when there is one output, else an object
    of output name -> values; a top-N result is its {class: probability} object."""
    if result.top_n is not None:
        return result_of(result)
    values = {name: json_values(np.asarray(value)) for name, value in result.tensors.items()}
    return next(iter(values.values())) if len(values) == 1 else values


def v2_outputs(results: list[Message], batched: bool, wanted: list[str] | None) -> list[dict]:
    """Per-instance results stacked back into v2 output tensors (batch dimension first when the
    model has one). A top-N result has two: `classes` and `probabilities`."""
    names = wanted or list(results[0].tensors)
    outputs = []
    for name in names:
        if any(name not in result.tensors for result in results):
            raise RequestError(f"no output {name!r}; the results have {', '.join(results[0].tensors)}")
        parts = [np.asarray(result.tensors[name]) for result in results]
        array = np.stack(parts) if batched else parts[0]
        outputs.append({
            "name": name,
            "shape": list(array.shape),
            "datatype": V2_DATATYPES.get(array.dtype.name, "BYTES"),
            "data": json_values(array.reshape(-1)),
        })
    return outputs
