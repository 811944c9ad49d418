"""The predict routes' fast path: documented and routed by FastAPI like any other route, but
answered as plain ASGI ahead of FastAPI's middleware and routing.

FastAPI's own request handling (Request objects, dependency solving, response-model validation and
encoding, its middleware) took more of a /predict's time than everything else the bridge does
for it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, get_type_hints

from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.routing import Match
from starlette.types import Receive, Scope, Send

from cluster_serving.http.asgi.binary_tensors import HEADER_LENGTH, BinaryAnswer, send_binary, split_body
from cluster_serving.http.asgi.openapi import documented
from cluster_serving.http.asgi.responses import exception_response, send_json
from cluster_serving.http.errors import (
    InferenceFailed,
    InvalidRequest,
    ModelNotFound,
    NotReady,
    RateLimited,
    Timeout,
    TooLarge,
    Unauthenticated,
)
from cluster_serving.http.json_tensors import json_bytes, strict_json

BINARY_HEADER = HEADER_LENGTH.encode()
PREDICT_ERRORS = documented(
    InvalidRequest, Unauthenticated, ModelNotFound, TooLarge, RateLimited, InferenceFailed, NotReady, Timeout
)


class PredictRoute(APIRoute):
    """A predict route answered as plain ASGI: the body read as strict JSON whatever its
    Content-Type (the BigDL guide's `curl -d` examples send form-urlencoded), validated as the
    endpoint's `body` model with FastAPI's messages, the endpoint's answer written by orjson, any
    exception answered by the error table."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any):
        super().__init__(path, endpoint, **kwargs)
        self.body_model: type[BaseModel] = get_type_hints(endpoint)["body"]
        self.app = self.serve  # what FastAPI's routing calls too, should a request reach it that way

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await read_all(receive)  # BodyLimit's TooLarge comes from here
            if body is None:  # the client went away
                return
            header_length = next((value for key, value in scope["headers"] if key == BINARY_HEADER), None)
            request = read_request(body, self.body_model, header_length)
            answer = await self.endpoint(request, **scope["path_params"])
        except Exception as exc:
            return await exception_response(exc, scope)(scope, receive, send)
        if isinstance(answer, BinaryAnswer):
            return await send_binary(send, answer)
        await send_json(send, json_bytes(answer))


def predict_route(app: FastAPI, path: str, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Adds the decorated endpoint, whose JSON body is its `body` argument, as a POST `PredictRoute`."""

    def add(endpoint: Callable[..., Any]) -> Callable[..., Any]:
        app.router.add_api_route(
            path, endpoint, methods=["POST"], responses=PREDICT_ERRORS, route_class_override=PredictRoute, **kwargs
        )
        return endpoint

    return add


class PredictFront:
    """Hands the POSTs of the predict routes straight to their `PredictRoute`, past FastAPI's
    middleware and routing (a tenth of a /predict's time); FastAPI serves everything else, wrong
    methods on these paths included."""

    def __init__(self, app: FastAPI):
        self.app = app
        self.routes = [route for route in app.routes if isinstance(route, PredictRoute)]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            for route in self.routes:
                match, child = route.matches(scope)
                if match is Match.FULL:
                    return await route.serve({**scope, **child}, receive, send)
        await self.app(scope, receive, send)


async def read_all(receive: Receive) -> bytes | None:
    """The request's body; None when the client disconnected first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def read_request(body: bytes, model: type[BaseModel], header_length: bytes | None) -> BaseModel:
    """The request body as `model`; with the extension's header, the JSON part as `model` and the
    binary part on its private `_binary` (only models that declare one take binary data)."""
    if header_length is None:
        return read_body(body, model)
    if "_binary" not in model.__private_attributes__:
        raise InvalidRequest("this route takes no binary tensor data (Inference-Header-Content-Length)")
    json_part, binary = split_body(body, header_length.decode("latin-1"))
    request = read_body(json_part, model)
    request._binary = binary
    return request


def read_body(body: bytes, model: type[BaseModel]) -> BaseModel:
    """The body as strict JSON (see `strict_json`) validated as `model`; InvalidRequest says why
    not, in the words FastAPI's own reading used (from_attributes: a body that is no object is
    worded as FastAPI validated it)."""
    if not body:
        raise InvalidRequest("body: Field required")
    try:
        value = strict_json(body)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"body is not valid JSON: {exc.msg}") from None
    except (ValueError, RecursionError):  # not UTF-8, or nested past the parser's depth
        raise InvalidRequest("There was an error parsing the body") from None
    try:
        return model.model_validate(value, from_attributes=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise InvalidRequest(f"{'.'.join(str(part) for part in first['loc']) or 'body'}: {first['msg']}") from None
