"""A request's inputs as users write them, read into wire values, the record headers that name the
model and version to serve it, and a result as users see it.

The client library (`enqueue`) and the HTTP bridge (JSON instances) read inputs here alike, each
value by its kind (cluster_serving/wire/kinds.py, which lists the forms of the four input types).
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from cluster_serving.wire.codec import (
    DEADLINE_HEADER,
    MAX_URI_CHARS,
    MODEL_HEADER,
    MODEL_NAME,
    TOP_N_CLASSES,
    TOP_N_PROBABILITIES,
    VERSION_HEADER,
    Message,
    Value,
    encode_alike,
    encode_arrays,
    encode_message,
)
from cluster_serving.wire import open_inference
from cluster_serving.wire.kinds import KINDS, JsonHints
from cluster_serving.wire.open_inference import (
    JSON_REQUEST,
    MLSERVER_MODEL_HEADER,
    MLSERVER_VERSION_HEADER,
    PROTO_REQUEST,
    SELDON_TYPE_HEADER,
)
from cluster_serving.wire.tensors import TensorError, dense_array


class Result(dict[Any, Any]):
    """A result as users see it: output name -> ndarray, {class: probability} (top-N) or
    {'error': ...}; a dict (equal to a plain dict of the same items) that also says what served it:
    `model` (the model's name) and `version` (its version), None where the result does not say;
    and for an error, `error_code` (one of wire.ERROR_CODES; None from a job older than codes)."""

    __slots__ = ("model", "version", "error_code")

    def __init__(self, items: Any = (), model: str | None = None, version: int | None = None, error_code: str | None = None):
        super().__init__(items)
        self.model, self.version, self.error_code = model, version, error_code

    def __repr__(self) -> str:
        if self.model is None and self.version is None and self.error_code is None:
            return super().__repr__()
        code = f", error_code={self.error_code!r}" if self.error_code is not None else ""
        return f"Result({super().__repr__()}, model={self.model!r}, version={self.version!r}{code})"


MAX_VERSION = 2**63 - 1  # the job reads versions as int64
Headers = list[tuple[str, bytes]]


def request_headers(model: str | None, version: int | None, timeout: float | None = None) -> Headers | None:
    """The record headers naming `model` and `version` (None: no header) and the deadline
    `timeout` seconds from now (None: none); a name the repository cannot hold, a version that is
    not a positive integer or a timeout that is not a positive number raises ValueError."""
    headers: Headers = deadline_headers(timeout)
    if model is not None:
        headers.append((MODEL_HEADER, checked_model(model).encode()))
    if version is not None:
        if isinstance(version, bool) or not isinstance(version, numbers.Integral) or not 1 <= version <= MAX_VERSION:
            raise ValueError(f"version must be a positive integer (a version folder's name), got {version!r}")
        headers.append((VERSION_HEADER, str(int(version)).encode()))
    return headers or None


def deadline_headers(timeout: float | None) -> Headers:
    """The deadline header for `timeout` seconds from now; none for None."""
    if timeout is None:
        return []
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not 0 < timeout < 10**9:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return [(DEADLINE_HEADER, str(int((time.time() + timeout) * 1000)).encode())]


# How a client writes requests (InputQueue(protocol=...)): our format, MLServer's JSON, Seldon's two.
PROTOCOLS = ("native", "mlserver", "oip-json", "oip-protobuf")
_SELDON_TYPES = {"oip-json": JSON_REQUEST, "oip-protobuf": PROTO_REQUEST}


def protocol_headers(protocol: str, headers: Headers) -> Headers:
    """A request's headers in an OIP `protocol`: MLServer names the model and version in its own
    headers (the model's always, empty for the default model); Seldon's say the encoding."""
    if protocol == "mlserver":
        names = {MODEL_HEADER: MLSERVER_MODEL_HEADER, VERSION_HEADER: MLSERVER_VERSION_HEADER}
        renamed = [(names.get(name, name), value) for name, value in headers]
        if all(name != MLSERVER_MODEL_HEADER for name, _ in renamed):
            renamed.append((MLSERVER_MODEL_HEADER, b""))
        return renamed
    return [*headers, (SELDON_TYPE_HEADER, _SELDON_TYPES[protocol].encode())]


def encode_oip_request(protocol: str, uri: str, data: Mapping[str, Any]) -> bytes:
    """A request in an OIP `protocol`, its id the uri; each input an array of numbers or strings,
    the whole tensor (its batch dimension included where the model has one)."""
    if not isinstance(uri, str) or not uri:
        raise TensorError("uri must be a non-empty string")
    if not data:
        raise TensorError("a request needs at least one named input, e.g. enqueue(uri, x=array)")
    tensors = {name: dense_array(name, value) for name, value in data.items()}
    return open_inference.encode_request("json" if protocol in ("mlserver", "oip-json") else "protobuf", uri, tensors)


def checked_model(model: str) -> str:
    if not isinstance(model, str) or not MODEL_NAME.fullmatch(model):
        raise ValueError(
            f"model must be a model repository name ({MODEL_NAME.pattern}), got {model!r}; "
            "leave it out (None) for the default model"
        )
    return model


def encode_request(uri: str, data: Mapping[str, Any]) -> bytes:
    """The request's bytes; a value of no known form raises TensorError (a ValueError) naming its input.
    Number arrays alone take encode_arrays' path, the same bytes at 40% of the cost; anything
    else goes value by value."""
    if not isinstance(uri, str) or not uri:
        raise TensorError("uri must be a non-empty string")
    if not data:
        raise TensorError("a request needs at least one named input, e.g. enqueue(uri, x=array)")
    alone = encode_arrays(uri, data) if len(uri) <= MAX_URI_CHARS else None
    return alone if alone is not None else encode_by_kind(uri, data)


def encode_by_kind(uri: str, data: Mapping[str, Any]) -> bytes:
    """The request's bytes, each value read by its kind (wire_value): the general path, which
    encode_alike's must match byte for byte."""
    return encode_message(Message(uri, {name: wire_value(name, value) for name, value in data.items()}))


def encode_alike_requests(requests: list[tuple[str, Mapping[str, Any]]]) -> list[bytes] | None:
    """Each request's bytes, as encode_request's, when their inputs are arrays alike in names,
    number dtypes and shapes: encoded together, at an eighth of encode_by_kind's cost for small
    ones. None when they are not alike (encode each with encode_request, which also names what is
    wrong)."""
    uris = [uri for uri, _ in requests]
    if not all(isinstance(uri, str) and 0 < len(uri) <= MAX_URI_CHARS for uri in uris):
        return None
    return encode_alike(uris, [data for _, data in requests])


def wire_value(name: str, value: Any) -> Value:
    """A client's value as a wire value, read by the first kind that takes its form."""
    return next(kind for kind in KINDS if kind.takes(value)).from_client(name, value)


def json_inputs(
    instance: Any, dtype_of: Callable[[str], np.dtype | None], image_inputs: frozenset[str]
) -> dict[str, Value]:
    """One JSON instance -> its wire values; `dtype_of(name)` is the model's dtype for that input
    (None for one the model lacks: the job names it). Raises TensorError saying what is wrong."""
    if not isinstance(instance, dict) or not instance:
        raise TensorError("an instance must be a non-empty JSON object of input name -> value")
    return {name: _json_input(name, value, JsonHints(dtype_of(name), name in image_inputs))
            for name, value in instance.items()}


def _json_input(name: str, value: Any, hints: JsonHints) -> Value:
    """Read by the first kind that takes its form; only a JSON object can be no kind's, and its
    refusal names every kind's object form."""
    for kind in KINDS:
        if kind.takes_json(value, hints):
            return kind.from_json(name, value, hints)
    forms = " or ".join(kind.json_object for kind in KINDS if kind.json_object)
    raise TensorError(f"input {name!r}: an object must be {forms}")


def result_of(message: Message) -> Result:
    """A result as users see it: output name -> ndarray; with top_n, {class index: probability}
    best first; or {'error': message}. Its `model`, `version` and `error_code` are the message's."""
    items = _result_items(message)
    code = message.error_code if message.error is not None else "internal" if "error" in items else None
    return Result(items, message.model, message.model_version, code)


def _result_items(message: Message) -> dict[Any, Any]:
    if message.error is not None:
        return {"error": message.error}
    if message.top_n is not None:
        classes, probabilities = message.tensors.get(TOP_N_CLASSES), message.tensors.get(TOP_N_PROBABILITIES)
        if classes is None or probabilities is None:
            return {"error": "unreadable result: a top-N result without classes and probabilities"}
        return {int(cls): float(prob) for cls, prob in zip(classes, probabilities)}
    return message.tensors
