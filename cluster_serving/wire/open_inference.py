"""The Open Inference Protocol (OIP, KServe v2) on Kafka, as the two serving systems that serve it
there write it, each request answered in the encoding it came in:

- Seldon MLServer's Kafka server: the value a JSON `InferenceRequest`, the model in header
  `mlserver-model`, its version in `mlserver-version`, the key the request id (the body's `id`
  where there is no key); answered with a JSON `InferenceResponse` of the same id.
- Seldon Core 2: the value a protobuf `ModelInferRequest` (or its JSON), header
  `seldon-infer-type` saying which (a response kind too: Seldon chains a model's outputs into the
  next one's inputs); answered with a `ModelInferResponse` in the same encoding. A record with no
  such header whose value is not our own format is tried as a `ModelInferRequest`, as Seldon does.

The protobuf messages are the OIP working group's generated classes (`open-inference-grpc`),
loaded, like orjson, with the first OIP request: the serving core runs without them (the stage
benchmark's bare Python). Every size and shape is checked against the data before an array is
made of it; what does not parse is a DecodeError, the request's `bad_request`.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from cluster_serving.wire.tensors import (
    V2_NUMPY_DTYPES,
    TensorError,
    dense_array,
    json_values,
    raw_bytes,
    raw_values,
    v2_datatype,
)
from cluster_serving.wire.values import MAX_RANK, MAX_TENSORS, DecodeError, Message, TooLarge, check_uri

# The record's timestamp (epoch ms), which the JVM adds to an OIP request's headers: its `timeout`
# parameter (microseconds, as Triton's) counts from it.
RECORD_TIMESTAMP_HEADER = "cluster-serving-record-timestamp"
MLSERVER_MODEL_HEADER = "mlserver-model"
MLSERVER_VERSION_HEADER = "mlserver-version"
SELDON_TYPE_HEADER = "seldon-infer-type"
JSON_REQUEST, JSON_RESPONSE = "json/inferModelRequest", "json/inferModelResponse"
PROTO_REQUEST, PROTO_RESPONSE = "proto/InferModelRequest", "proto/InferModelResponse"
SELDON_TYPES = (JSON_REQUEST, JSON_RESPONSE, PROTO_REQUEST, PROTO_RESPONSE)
# Our own format's first bytes: format 2's magic, an Arrow IPC stream's continuation marker.
_NATIVE_STARTS = (b"CST2", b"\xff\xff\xff\xff")
# The typed-contents field of each datatype in a protobuf tensor (FP16: raw contents only).
_CONTENTS = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}


@functools.cache
def _library(name: str) -> ModuleType:
    return importlib.import_module(name)


def _orjson() -> ModuleType:
    return _library("orjson")


def _messages() -> ModuleType:
    """The OIP protobuf messages (ModelInferRequest, ModelInferResponse)."""
    return _library("open_inference.grpc.protocol")


def _parsed(message_type: Any, payload: bytes) -> Any | None:
    """`payload` parsed as `message_type`; None where it is not one."""
    try:
        return message_type.FromString(payload)
    except _library("google.protobuf.message").DecodeError:
        return None


@dataclass
class OipRequest:
    """What an OIP request asked, besides its inputs: how to answer it (`encoding` "json" or
    "protobuf"), its id, the model and version its body names ("" where it names none), the
    outputs it wants (None: all) and its `timeout` parameter in microseconds (None: none)."""

    encoding: str
    id: str
    model_name: str = ""
    model_version: str = ""
    outputs: list[str] | None = None
    timeout_us: int | None = None


def protocol_of(headers: Sequence[tuple[str, bytes | None]], payload: bytes) -> str | None:
    """The encoding ("json", "protobuf", or "protobuf-response": a Seldon ModelInferResponse to
    chain) a record's headers say it is in; None for our own format. A `seldon-infer-type` it
    does not know is a DecodeError."""
    for name, value in headers:
        if name == SELDON_TYPE_HEADER:
            kind = (value or b"").decode(errors="replace")
            if kind not in SELDON_TYPES:
                raise DecodeError(f"header {SELDON_TYPE_HEADER} {kind[:60]!r} is none of {', '.join(SELDON_TYPES)}")
            return "json" if kind.startswith("json/") else "protobuf-response" if kind == PROTO_RESPONSE else "protobuf"
    if any(name == MLSERVER_MODEL_HEADER for name, _ in headers):
        return "json"
    return None


def sniffed_encoding(payload: bytes) -> str | None:
    """The OIP encoding to try a record without protocol headers in, when our format did not read
    it: JSON for an object, else protobuf (Seldon's "general case"); None for our format's bytes."""
    if not payload or payload[:4] in _NATIVE_STARTS:
        return None
    return "json" if payload[:1] == b"{" else "protobuf"


def decode_request(payload: bytes, encoding: str, key: str | None, max_bytes: int) -> tuple[Message, OipRequest]:
    """An OIP request record -> the message to serve (its uri the record key, else the body's id;
    its tensors as the request shaped them) and what to answer it with."""
    if len(payload) > max_bytes:
        raise TooLarge(f"message of {len(payload)} bytes exceeds the limit of {max_bytes}")
    if encoding == "json":
        return _from_json(payload, key, max_bytes)
    return _from_protobuf(payload, key, max_bytes, response_kind=encoding == "protobuf-response")


def answer_to(encoding: str, key: str | None) -> OipRequest:
    """How to answer a record in `encoding` that did not parse: an error in its encoding."""
    return OipRequest("json" if encoding == "json" else "protobuf", key or "")


def _from_json(payload: bytes, key: str | None, max_bytes: int) -> tuple[Message, OipRequest]:
    try:
        body = _orjson().loads(payload)
    except ValueError as exc:  # orjson.JSONDecodeError
        raise DecodeError(f"not an OIP JSON request: {exc}") from None
    if not isinstance(body, dict):
        raise DecodeError("not an OIP JSON request: the value is not a JSON object")
    # A Seldon response kind chains a model's outputs into the next one's inputs.
    entries = body.get("inputs", body.get("outputs"))
    if not isinstance(entries, list) or not entries:
        raise DecodeError("an OIP JSON request needs a non-empty list of inputs")
    request = OipRequest("json", _id(key, body.get("id")), _text(body.get("model_name")), _text(body.get("model_version")),
                         _wanted(body.get("outputs") if "inputs" in body else None), _json_timeout(body.get("parameters")))
    tensors = _named([(_json_tensor(entry, max_bytes)) for entry in _at_most(entries)])
    return Message(_uri(key, request.id), tensors), request


def _json_tensor(entry: Any, max_bytes: int) -> tuple[str, np.ndarray]:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or "data" not in entry:
        raise DecodeError("an OIP input needs a name, a shape, a datatype and data")
    name = entry["name"]
    shape, dtype = _shape(name, entry.get("shape")), _dtype(name, entry.get("datatype"))
    _check_size(name, shape, dtype, max_bytes)
    data = entry["data"]
    values = data if isinstance(data, list) else [data]
    try:
        array = dense_array(name, values, dtype, from_json=True)
    except TensorError as exc:
        raise DecodeError(str(exc)) from None
    if array.size != math.prod(shape):
        raise DecodeError(f"input {name!r}: {array.size} values do not fill shape {list(shape)}")
    return name, array.reshape(shape)


def _from_protobuf(payload: bytes, key: str | None, max_bytes: int, response_kind: bool = False
                   ) -> tuple[Message, OipRequest]:
    """A ModelInferRequest; failing that (or for a record that says it is one) a ModelInferResponse,
    the outputs of the model before, as Seldon chains them."""
    body = None if response_kind else _parsed(_messages().ModelInferRequest, payload)
    if body is None or not body.inputs:
        response = _parsed(_messages().ModelInferResponse, payload)
        if response is None or not response.outputs:
            kind = "ModelInferResponse with outputs" if response_kind else "ModelInferRequest with inputs"
            raise DecodeError(f"not an OIP protobuf {kind}")
        entries, raw = response.outputs, response.raw_output_contents
        request = OipRequest("protobuf", _id(key, response.id), response.model_name, response.model_version)
    else:
        entries, raw = body.inputs, body.raw_input_contents
        wanted = [output.name for output in body.outputs] or None
        request = OipRequest("protobuf", _id(key, body.id), body.model_name, body.model_version, wanted,
                             _protobuf_timeout(body.parameters))
    if raw and len(raw) != len(entries):
        raise DecodeError(f"{len(raw)} raw contents for {len(entries)} inputs")
    tensors = _named([_protobuf_tensor(entry, raw[i] if raw else None, max_bytes)
                      for i, entry in enumerate(_at_most(entries))])
    return Message(_uri(key, request.id), tensors), request


def _protobuf_tensor(entry: Any, raw: bytes | None, max_bytes: int) -> tuple[str, np.ndarray]:
    name = entry.name
    shape, dtype = _shape(name, list(entry.shape)), _dtype(name, entry.datatype)
    _check_size(name, shape, dtype, max_bytes)
    count = math.prod(shape)
    if raw is not None:
        try:
            array = raw_values(name, dtype, raw)
        except TensorError as exc:
            raise DecodeError(str(exc)) from None
    else:
        field = _CONTENTS.get(entry.datatype)
        if field is None:
            raise DecodeError(f"input {name!r}: {entry.datatype} travels in raw contents only")
        values = getattr(entry.contents, field)
        try:
            array = _utf8(name, list(values)) if dtype.kind == "O" else dense_array(name, list(values), dtype)
        except TensorError as exc:  # int_contents holds INT8 and INT16 too: a value may not fit
            raise DecodeError(str(exc)) from None
    if array.size != count:
        raise DecodeError(f"input {name!r}: {array.size} values do not fill shape {list(shape)}")
    return name, array.reshape(shape)


def _utf8(name: str, items: list[bytes]) -> np.ndarray:
    try:
        return np.array([item.decode() for item in items], dtype=object)
    except UnicodeDecodeError:
        raise DecodeError(f"input {name!r}: BYTES values must be UTF-8 text") from None


def _at_most(entries: Sequence[Any]) -> Sequence[Any]:
    if len(entries) > MAX_TENSORS:
        raise DecodeError(f"more than {MAX_TENSORS} inputs")
    return entries


def _named(tensors: list[tuple[str, np.ndarray]]) -> dict[str, np.ndarray]:
    named = dict(tensors)
    if len(named) != len(tensors):
        raise DecodeError("an input appears more than once")
    return named


def _shape(name: str, shape: Any) -> tuple[int, ...]:
    if (not isinstance(shape, list) or len(shape) > MAX_RANK
            or not all(isinstance(dim, int) and not isinstance(dim, bool) and 0 <= dim < 2**31 for dim in shape)):
        raise DecodeError(f"input {name!r}: invalid shape {str(shape)[:80]}")
    return tuple(shape)


def _dtype(name: str, datatype: Any) -> np.dtype:
    if not isinstance(datatype, str) or datatype not in V2_NUMPY_DTYPES:
        raise DecodeError(f"input {name!r}: unknown datatype {str(datatype)[:40]!r} (known: {', '.join(V2_NUMPY_DTYPES)})")
    return V2_NUMPY_DTYPES[datatype]


def _check_size(name: str, shape: tuple[int, ...], dtype: np.dtype, max_bytes: int) -> None:
    """A shape is only a claim: refused before anything is made of it when it is over the limit,
    counting a 0 dimension as 1 (an empty [2**31, 2**31, 0] nests into billions of lists)."""
    size = math.prod(max(dim, 1) for dim in shape) * (8 if dtype.kind == "O" else dtype.itemsize)
    if size > max_bytes:
        raise TooLarge(f"input {name!r}: {size} bytes once decoded, over the limit of {max_bytes}")


def _json_timeout(parameters: Any) -> int | None:
    timeout = parameters.get("timeout") if isinstance(parameters, dict) else None
    return _timeout(timeout) if timeout is not None else None


def _protobuf_timeout(parameters: Any) -> int | None:
    if "timeout" not in parameters:
        return None
    parameter = parameters["timeout"]
    return _timeout(getattr(parameter, parameter.WhichOneof("parameter_choice") or "int64_param"))


def _timeout(value: Any) -> int:
    """A `timeout` parameter: microseconds, a whole number from 1 up."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**63:
        raise DecodeError(f"the timeout parameter must be a positive whole number of microseconds, got {str(value)[:40]!r}")
    return value


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _wanted(outputs: Any) -> list[str] | None:
    if not isinstance(outputs, list) or not outputs:
        return None
    return [entry["name"] for entry in outputs if isinstance(entry, dict) and isinstance(entry.get("name"), str)]


def _id(key: str | None, body_id: Any) -> str:
    """The request id: the record key takes precedence over the body's id (as MLServer's)."""
    return key if key else _text(body_id)


def _uri(key: str | None, request_id: str) -> str:
    uri = key or request_id
    check_uri(uri)
    return uri


def missing_output(request: OipRequest, result: Message) -> str | None:
    """Why the outputs the request asked for are not all in the result; None when they are."""
    missing = [name for name in request.outputs or () if name not in result.tensors]
    return f"no output {missing[0]!r}; the model has {', '.join(result.tensors)}" if missing else None


def encode_answer(request: OipRequest, result: Message) -> bytes:
    """The answer to an OIP request in its encoding: an `InferenceResponse` / `ModelInferResponse`
    of the request's id, the model and version that served it and its outputs (the ones it asked
    for); an error result as the OIP error (`error`) with its `error_code`."""
    outputs = result.tensors
    if request.outputs:  # the serving path answered a missing one with an error (missing_output)
        outputs = {name: outputs[name] for name in request.outputs if name in outputs}
    arrays = {name: np.asarray(value) for name, value in outputs.items()}
    if request.encoding == "json":
        return _json_answer(request, result, arrays)
    return _protobuf_answer(request, result, arrays)


def _json_answer(request: OipRequest, result: Message, arrays: dict[str, np.ndarray]) -> bytes:
    body: dict[str, Any] = {"model_name": result.model or request.model_name, "id": request.id}
    if result.model_version is not None:
        body["model_version"] = str(result.model_version)
    if result.error is not None:
        body |= {"error": result.error, "error_code": result.error_code or "internal"}
    else:
        body["outputs"] = [{"name": name, "shape": list(array.shape), "datatype": v2_datatype(array),
                            "data": json_values(array.reshape(-1))} for name, array in arrays.items()]
    return _orjson().dumps(body)


def _protobuf_answer(request: OipRequest, result: Message, arrays: dict[str, np.ndarray]) -> bytes:
    response = _messages().ModelInferResponse(model_name=result.model or request.model_name, id=request.id)
    if result.model_version is not None:
        response.model_version = str(result.model_version)
    if result.error is not None:
        response.parameters["error"].string_param = result.error
        response.parameters["error_code"].string_param = result.error_code or "internal"
        return response.SerializeToString()
    for name, array in arrays.items():
        response.outputs.add(name=name, datatype=v2_datatype(array), shape=list(array.shape))
        response.raw_output_contents.append(raw_bytes(array))
    return response.SerializeToString()


def decode_answer(payload: bytes) -> Message | None:
    """An OIP answer on the result topic (JSON or protobuf) as a result message; None for our own format."""
    if payload[:4] in _NATIVE_STARTS:
        return None
    if payload[:1] == b"{":
        body = _orjson().loads(payload)
        tensors = {entry["name"]: _json_tensor(entry, 1 << 62)[1] for entry in body.get("outputs") or []}
        return _answer_message(body.get("id") or "", tensors, body.get("error"), body.get("error_code"),
                               body.get("model_name"), body.get("model_version"))
    response = _parsed(_messages().ModelInferResponse, payload)
    if response is None:
        raise DecodeError("not an OIP answer: neither JSON nor a protobuf ModelInferResponse")
    raw = response.raw_output_contents
    tensors = dict(_protobuf_tensor(entry, raw[i] if raw else None, 1 << 62) for i, entry in enumerate(response.outputs))
    parameters = response.parameters
    error = parameters["error"].string_param if "error" in parameters else None
    code = parameters["error_code"].string_param if "error_code" in parameters else None
    return _answer_message(response.id, tensors, error, code, response.model_name, response.model_version)


def _answer_message(uri: str, tensors: dict[str, np.ndarray], error: str | None, code: str | None,
                    model: str | None, version: str | None) -> Message:
    number = int(version) if version and version.isdigit() else None
    return Message(uri, tensors, error, code, model=model or None, model_version=number)


def encode_request(encoding: str, request_id: str, tensors: dict[str, np.ndarray], model: str = "",
                   version: str = "") -> bytes:
    """An OIP request of `tensors` as its producers write it: JSON (an `InferenceRequest`) or protobuf
    (a `ModelInferRequest` with raw contents); the client's `protocol=`."""
    arrays = {name: np.asarray(value) for name, value in tensors.items()}
    if encoding == "json":
        return _orjson().dumps({"id": request_id, "inputs": [
            {"name": name, "shape": list(array.shape), "datatype": v2_datatype(array), "data": json_values(array.reshape(-1))}
            for name, array in arrays.items()]})
    request = _messages().ModelInferRequest(model_name=model, id=request_id)
    if version:
        request.model_version = version
    for name, array in arrays.items():
        request.inputs.add(name=name, datatype=v2_datatype(array), shape=list(array.shape))
        request.raw_input_contents.append(raw_bytes(array))
    return request.SerializeToString()

