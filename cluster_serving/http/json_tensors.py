"""JSON <-> tensors for the HTTP bridge: the BigDL/KServe v1 `instances` forms and the KServe v2
(open inference protocol) tensors, both ways.

JSON numbers carry no dtype, so dense values are typed from the model's signature; a value that
would change meaning on the way (a fraction for an integer input, a number out of the dtype's
range, a number for a string input, NaN or an infinity) is refused instead of silently converted.
Refusals are `bridge.errors` (or the connectors' TensorError): which status each gets is decided
there, not here.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np
import orjson

from cluster_serving.http.errors import InvalidRequest, TooLarge
from cluster_serving.runtime.signature import ModelSignature
from cluster_serving.wire.codec import Message, Value
from cluster_serving.wire.inputs import json_inputs, result_of
from cluster_serving.wire.tensors import V2_NUMPY_DTYPES, TensorError, dense_array, json_values, v2_datatype


def strict_json(body: bytes) -> Any:
    """The body as JSON, without Python's extensions: NaN and +-Infinity are not JSON, and read
    as numbers they would reach the model as non-finite values.

    orjson reads it, in a seventh to a tenth of `json`'s time; what it refuses goes to `json`,
    which takes what orjson does not (1e999 as infinity, which `dense_array` then refuses by name;
    a byte order mark; UTF-16) and words the errors. Integers past 64 bits read as floats."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return json.loads(body, parse_constant=_not_json)


def json_bytes(value: Any) -> bytes:
    """`value` as compact JSON; top-N objects have integer keys, which JSON writes as strings."""
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)


def _not_json(constant: str) -> NoReturn:
    raise json.JSONDecodeError(f"{constant} is not a JSON value", "", 0)


def read_instances(
    instances: list[Any], signature: ModelSignature, image_inputs: frozenset[str]
) -> list[dict[str, Value]]:
    """`instances` entries -> their wire values, typed by the model's signature; an error names
    the instance it is about."""
    return [_instance(index, instance, signature, image_inputs) for index, instance in enumerate(instances)]


def _instance(index: int, instance: Any, signature: ModelSignature, image_inputs: frozenset[str]) -> dict[str, Value]:
    try:
        return json_inputs(instance, lambda name: _dtype(signature, name), image_inputs)
    except TensorError as exc:
        raise TensorError(f"instance {index}: {exc}") from None


def _dtype(signature: ModelSignature, name: str) -> np.dtype | None:
    info = signature.input(name)
    return info.dtype if info else None


@dataclass(frozen=True)
class V2Tensor:
    """One v2 input whose shape, datatype and data were checked against each other."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    data: list[Any] | np.ndarray  # JSON values, or the binary extension's values


def v2_instances(
    inputs: list[dict], signature: ModelSignature, max_instances: int, max_instance_bytes: int
) -> list[dict[str, np.ndarray]]:
    """KServe v2 `inputs` -> one instance per row of the batch dimension (a single instance when
    the model takes no batch dimension, as the job then runs instances one by one). A shape is
    only a claim: it is checked against the data, the batch and the size limits before any array
    is built from it."""
    tensors = [_v2_tensor(tensor, signature) for tensor in inputs]
    twice = [name for name, count in Counter(tensor.name for tensor in tensors).items() if count > 1]
    if twice:
        raise InvalidRequest(f"input {twice[0]!r} given twice")
    count = _v2_batch(tensors, signature.batched, max_instances)
    instance_bytes = sum(math.prod(tensor.shape) * tensor.dtype.itemsize for tensor in tensors) // count
    if instance_bytes > max_instance_bytes:  # strings counted as pointers: a lower bound
        raise TooLarge(f"{instance_bytes} bytes of values per instance, over the limit of {max_instance_bytes}")
    try:
        arrays = {tensor.name: _array(tensor) for tensor in tensors}
    except TensorError as exc:  # as InvalidRequest: all that v2_instances refuses is a BridgeError
        raise InvalidRequest(str(exc)) from None
    if not signature.batched:
        return [arrays]
    return [{name: array[i] for name, array in arrays.items()} for i in range(count)]


def _v2_tensor(tensor: dict, signature: ModelSignature) -> V2Tensor:
    """Checks the datatype, and that the data, flat in row-major order or nested as the shape,
    fill the shape."""
    name, shape, data = tensor["name"], tuple(tensor["shape"]), tensor["data"]
    dtype = _v2_dtype(name, tensor["datatype"], signature)
    if isinstance(data, np.ndarray):  # binary data: flat, typed as the request declared it
        if data.size != math.prod(shape):
            raise InvalidRequest(f"input {name!r}: {data.size} values do not fill shape {list(shape)}")
    elif not any(isinstance(item, list) for item in data):
        if len(data) != math.prod(shape):
            raise InvalidRequest(f"input {name!r}: {len(data)} values do not fill shape {list(shape)}")
    elif not _nested_as(data, shape):
        raise InvalidRequest(f"input {name!r}: nested data do not have shape {list(shape)}")
    return V2Tensor(name, shape, dtype, data)


def _array(tensor: V2Tensor) -> np.ndarray:
    """The tensor's values as the model's dtype; only JSON values are refused for being non-finite
    (JSON has no NaN: there it means an overflow), binary floats are taken as they are."""
    from_json = not isinstance(tensor.data, np.ndarray)
    return dense_array(tensor.name, tensor.data, tensor.dtype, from_json=from_json).reshape(tensor.shape)


def _nested_as(data: Any, shape: tuple[int, ...]) -> bool:
    if not shape:
        return not isinstance(data, list)
    return isinstance(data, list) and len(data) == shape[0] and all(_nested_as(item, shape[1:]) for item in data)


def v2_numpy_dtype(name: str, datatype: str) -> np.dtype:
    """The numpy dtype of an open inference protocol datatype; InvalidRequest for a name it lacks."""
    if datatype not in V2_NUMPY_DTYPES:
        raise InvalidRequest(f"input {name!r}: unknown datatype {datatype!r} (known: {', '.join(V2_NUMPY_DTYPES)})")
    return V2_NUMPY_DTYPES[datatype]


def _v2_dtype(name: str, datatype: str, signature: ModelSignature) -> np.dtype:
    """The dtype to type the data as: the model's for an input it has, so values are checked
    against the range the model takes. A datatype of another kind is refused: the job casts
    INT32 or BOOL to FP32 without a word."""
    declared, info = v2_numpy_dtype(name, datatype), signature.input(name)
    if info is None:
        return declared  # the job names the unknown input
    if _kind(declared) != _kind(info.dtype):
        raise InvalidRequest(f"input {name!r}: expects {info.datatype}, got {datatype}")
    return info.dtype


def _kind(dtype: np.dtype) -> str:
    """numpy's kind, signed and unsigned integers as one: values are range-checked anyway."""
    return "i" if dtype.kind == "u" else dtype.kind


def _v2_batch(tensors: list[V2Tensor], batched: bool, max_instances: int) -> int:
    """The number of instances: the inputs' common first dimension, 1 to `max_instances`."""
    if not batched:
        return 1
    leading = {tensor.shape[:1] for tensor in tensors}
    if len(leading) != 1 or () in leading:
        raise InvalidRequest("every input needs the same leading batch dimension")
    (count,) = leading.pop()
    if count < 1:
        raise InvalidRequest("the batch dimension is 0: a request needs at least one instance")
    if count > max_instances:
        raise TooLarge(f"batch of {count}, over the limit of {max_instances}")
    return count


def prediction(result: Message) -> Any:
    """One result as a v1 prediction: the output's values when there is one output, else an object
    of output name -> values; a top-N result is its {class: probability} object."""
    if result.top_n is not None:
        return result_of(result)
    values = {name: json_values(np.asarray(value)) for name, value in result.tensors.items()}
    return next(iter(values.values())) if len(values) == 1 else values


def v2_output_arrays(results: list[Message], batched: bool, wanted: list[str] | None) -> dict[str, np.ndarray]:
    """Per-instance results stacked back into output tensors (batch dimension first when the
    model has one), by output name. A top-N result has two: `classes` and `probabilities`."""
    names = wanted or list(results[0].tensors)
    arrays = {}
    for name in names:
        if any(name not in result.tensors for result in results):
            raise InvalidRequest(f"no output {name!r}; the results have {', '.join(results[0].tensors)}")
        parts = [np.asarray(result.tensors[name]) for result in results]
        arrays[name] = np.stack(parts) if batched else parts[0]
    return arrays


def v2_json_output(name: str, array: np.ndarray) -> dict[str, Any]:
    return {"name": name, "shape": list(array.shape), "datatype": v2_datatype(array), "data": json_values(array.reshape(-1))}
