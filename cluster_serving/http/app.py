"""The bridge's ASGI app: each protocol's routes (`bridge.protocol`) over one started `Bridge`,
FastAPI routing them and writing the OpenAPI document, the predict fast path in front, the
guards around it, every response counted.

FastAPI is what KServe's own model server is built on; every error it meets is answered by the
error table, as the fast path's and the guards' are.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp

from cluster_serving.http.asgi.fast_path import PredictFront
from cluster_serving.http.asgi.guards import BearerToken, BodyLimit, CountResponses
from cluster_serving.http.asgi.openapi import drop_unused_422
from cluster_serving.http.asgi.responses import error_response, exception_response
from cluster_serving.http.dataplane import Bridge
from cluster_serving.http.errors import HTTP_STATUS
from cluster_serving.http.protocol import bigdl, kserve_v1, kserve_v2

PROTOCOLS = (bigdl, kserve_v1, kserve_v2)


def create_app(bridge: Bridge) -> ASGIApp:
    """The routes over a started `bridge` (see `bridge.server.run_bridge`), every response counted."""
    app = FastAPI(
        title="cluster-serving HTTP bridge",
        version="1",
        description="BigDL Cluster Serving's /predict and /metrics and KServe v1/v2 routes over the Kafka topics.",
        docs_url=None,  # the interactive pages load scripts from a CDN
        redoc_url=None,
    )
    add_error_handlers(app)
    for protocol in PROTOCOLS:
        protocol.register(app, bridge)
    drop_unused_422(app)
    guarded: ASGIApp = BodyLimit(PredictFront(app), bridge.config.http.max_body_bytes)
    if bridge.token:
        guarded = BearerToken(guarded, bridge.token)
    return CountResponses(guarded, bridge.metrics)


def add_error_handlers(app: FastAPI) -> None:
    """The error table's errors answered by it; routing's own errors (no such route, wrong method)
    as JSON too; anything else a logged 500."""

    async def answer(request: Request, exc: Exception) -> JSONResponse:
        return exception_response(exc, request.scope)

    @app.exception_handler(HTTPException)
    async def routing_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = exc.detail if exc.status_code != 404 or exc.detail != "Not Found" else f"no route {request.url.path}"
        return error_response(exc.status_code, str(message))

    for error in HTTP_STATUS:
        app.add_exception_handler(error, answer)
    app.add_exception_handler(Exception, answer)
