"""The HTTP bridge: BigDL's `/predict` and `/metrics`, KServe v1 and v2 routes, one JSON error shape.

    python -m client.http_bridge --config run/serving/config.yaml     (or: cluster-serving http)

FastAPI (what KServe's own model server is built on) validates the bodies and writes the OpenAPI
document at /openapi.json; uvicorn serves it. Every error is `{"error": "<message>"}`.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import signal
import socket
import sys
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

import h11
import uvicorn
from fastapi import FastAPI, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from client.bridge import Bridge
from client.bridge_metrics import BridgeMetrics
from client.http_json import RequestError, instance_inputs, prediction, strict_json, v2_instances, v2_outputs
from conf import ConfigError, load_config
from connectors.codec import MAX_RANK

log = logging.getLogger("cluster_serving.bridge")
READY_LINE = "http bridge listening on "
PLATFORM = "onnxruntime_onnx"
OPEN_ROUTES = ("/v2/health/",)  # reachable without the bearer token: liveness/readiness probes


class ErrorBody(BaseModel):
    error: str


class PredictRequest(BaseModel):
    instances: list[dict[str, Any]] = Field(min_length=1, description="one object of input name -> value per instance")


class PredictResponse(BaseModel):
    predictions: list[Any]


class InferTensor(BaseModel):
    name: str
    shape: list[Annotated[int, Field(ge=0, strict=True)]] = Field(max_length=MAX_RANK)
    datatype: str
    data: list[Any]
    parameters: dict[str, Any] | None = None


class RequestedOutput(BaseModel):
    name: str
    parameters: dict[str, Any] | None = None


class InferRequest(BaseModel):
    id: str | None = None
    inputs: list[InferTensor] = Field(min_length=1)
    outputs: list[RequestedOutput] | None = None
    parameters: dict[str, Any] | None = None


class InferResponse(BaseModel):
    model_name: str
    id: str | None = None
    outputs: list[InferTensor]


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error statuses a route can answer with."""
    return {status: {"model": ErrorBody} for status in statuses}


PREDICT_ERRORS = errors(400, 401, 404, 413, 429, 500, 503, 504)


class JsonBodies:
    """Reads every POST body as JSON, whatever its Content-Type: the BigDL guide's `curl -d`
    examples send form-urlencoded, and FastAPI would otherwise not parse them."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(key, value) for key, value in scope["headers"] if key != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


class BodyLimit:
    """Answers 413 for bodies over `max_bytes`, declared or streamed, before anything parses them."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.max_bytes:
            response = error_response(413, f"request body over the limit of {self.max_bytes} bytes")
            return await response(scope, receive, send)
        received = 0

        async def limited() -> dict:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                # FastAPI re-raises HTTPExceptions from body reading as they are.
                raise HTTPException(413, f"request body over the limit of {self.max_bytes} bytes")
            return message

        await self.app(scope, limited, send)


class StrictJsonRequest(Request):
    """A request whose body is read as strict JSON (see `strict_json`)."""

    async def json(self) -> Any:
        return strict_json(await self.body())


class StrictJsonRoute(APIRoute):
    """FastAPI's route with a `StrictJsonRequest`: FastAPI's documented way to change how a body
    is read, as its own reading is Starlette's `json.loads`, which takes NaN and Infinity."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            return await handler(StrictJsonRequest(request.scope, request.receive))

        return strict_handler


class CountResponses:
    """Counts every response by status. It wraps the whole FastAPI app: FastAPI's outermost
    ServerErrorMiddleware sends the 500 of an unexpected exception past any middleware added
    to the app, so one added there would miss it."""

    def __init__(self, app: ASGIApp, metrics: BridgeMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count_response(message["status"])
            await send(message)

        await self.app(scope, receive, counted)


def json_error_protocol(metrics: BridgeMetrics) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol, answering a request it cannot parse (a malformed request line,
    header or Content-Length), before any app sees it, in the bridge's JSON error shape and counted
    like every other response; uvicorn's own answer is plain text."""

    class JsonErrorProtocol(H11Protocol):
        def send_400_response(self, msg: str) -> None:
            # uvicorn calls this in its `except h11.RemoteProtocolError:`, whose reason says more.
            reason = sys.exc_info()[1]
            message = f"malformed HTTP request: {reason}" if isinstance(reason, h11.RemoteProtocolError) else msg
            body = json.dumps({"error": message}).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            response = h11.Response(status_code=400, headers=headers, reason=b"Bad Request")
            for event in (response, h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()
            metrics.count_response(400)

    return JsonErrorProtocol


def error_response(status: int, message: str) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def create_app(bridge: Bridge) -> ASGIApp:
    """The routes over a started `bridge` (see `run_bridge`), every response counted."""
    app = FastAPI(
        title="cluster-serving HTTP bridge",
        version="1",
        description="BigDL Cluster Serving's /predict and /metrics and KServe v1/v2 routes over the Kafka topics.",
        docs_url=None,  # the interactive pages load scripts from a CDN
        redoc_url=None,
    )
    app.router.route_class = StrictJsonRoute
    app.add_middleware(JsonBodies)
    app.add_middleware(BodyLimit, max_bytes=bridge.config.http.max_body_bytes)
    add_error_handlers(app)
    add_authorization(app, bridge)
    add_routes(app, bridge)
    drop_unused_422(app)
    return CountResponses(app, bridge.metrics)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError) -> JSONResponse:
        return error_response(exc.status, str(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = exc.detail if exc.status_code != 404 or exc.detail != "Not Found" else f"no route {request.url.path}"
        return error_response(exc.status_code, str(message))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            return error_response(400, f"body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
        where = ".".join(str(part) for part in first["loc"][1:]) or "body"
        return error_response(400, f"{where}: {first['msg']}")

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


def add_authorization(app: FastAPI, bridge: Bridge) -> None:
    @app.middleware("http")
    async def authorize(request: Request, call_next: Any) -> Any:
        if bridge.token and not request.url.path.startswith(OPEN_ROUTES):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {bridge.token}".encode()):
                return error_response(401, "missing or wrong bearer token")
        return await call_next(request)


def add_routes(app: FastAPI, bridge: Bridge) -> None:
    name = bridge.model_name
    # The served name as the documented example, so generated requests (schemathesis) reach it.
    model_path = Path(examples=[name], description="the served model's name (model.name)")

    def check_model(model_name: str) -> None:
        if model_name != name:
            raise RequestError(f"model {model_name!r} not found; this bridge serves {name!r}", 404)

    async def predict_instances(instances: list[dict[str, Any]]) -> PredictResponse:
        bridge.admit()
        if len(instances) > bridge.config.http.max_instances:
            raise RequestError(f"{len(instances)} instances, over the limit of {bridge.config.http.max_instances}", 413)
        with bridge.metrics.request.time():
            inputs = [_instance(i, item) for i, item in enumerate(instances)]
            results = await bridge.infer(inputs)
        return PredictResponse(predictions=[prediction(result) for result in results])

    def _instance(index: int, instance: dict[str, Any]) -> dict[str, Any]:
        try:
            return instance_inputs(instance, bridge.signature, bridge.image_inputs)
        except RequestError as exc:
            raise RequestError(f"instance {index}: {exc}", exc.status) from None

    @app.post("/predict", response_model=PredictResponse, responses=PREDICT_ERRORS, tags=["BigDL"])
    async def predict(body: PredictRequest) -> PredictResponse:
        """BigDL Cluster Serving's predict: one prediction per instance, in order."""
        return await predict_instances(body.instances)

    @app.get("/metrics", responses=errors(401), tags=["metrics"])
    async def metrics() -> list[dict[str, Any]]:
        """Dropwizard-style JSON: timers in milliseconds, counters."""
        return bridge.metrics.dropwizard()

    @app.get("/metrics/prometheus", response_class=PlainTextResponse, responses=errors(401), tags=["metrics"])
    async def metrics_prometheus() -> str:
        """The same metrics in Prometheus' text format."""
        return bridge.metrics.prometheus()

    @app.get("/v1/models", responses=errors(401), tags=["KServe v1"])
    async def v1_models() -> dict[str, list[str]]:
        return {"models": [name]}

    @app.get("/v1/models/{model_name}", responses=errors(401, 404), tags=["KServe v1"])
    async def v1_model(model_name: str = model_path) -> dict[str, Any]:
        check_model(model_name)
        return {"name": name, "ready": await bridge.not_ready_reason() is None}

    @app.post("/v1/models/{model_name}:predict", response_model=PredictResponse, responses=PREDICT_ERRORS, tags=["KServe v1"])
    async def v1_predict(body: PredictRequest, model_name: str = model_path) -> PredictResponse:
        check_model(model_name)
        return await predict_instances(body.instances)

    @app.get("/v2", responses=errors(401), tags=["KServe v2"])
    async def v2_server() -> dict[str, Any]:
        return {"name": "cluster-serving", "version": app.version, "extensions": []}

    @app.get("/v2/health/live", tags=["KServe v2"])
    async def live() -> dict[str, bool]:
        return {"live": True}

    @app.get("/v2/health/ready", responses=errors(503), tags=["KServe v2"])
    async def ready() -> dict[str, bool]:
        reason = await bridge.not_ready_reason()
        if reason:
            raise RequestError(f"not ready: {reason}", 503)
        return {"ready": True}

    @app.get("/v2/models/{model_name}", response_model=ModelMetadata, responses=errors(401, 404), tags=["KServe v2"])
    async def v2_metadata(model_name: str = model_path) -> ModelMetadata:
        check_model(model_name)
        signature = bridge.signature
        return ModelMetadata(
            name=name, versions=["1"], platform=PLATFORM,
            inputs=[TensorMetadata(**info.metadata()) for info in signature.inputs],
            outputs=[TensorMetadata(**info.metadata()) for info in signature.outputs],
        )

    @app.get("/v2/models/{model_name}/ready", responses=errors(401, 404, 503), tags=["KServe v2"])
    async def v2_model_ready(model_name: str = model_path) -> dict[str, Any]:
        check_model(model_name)
        reason = await bridge.not_ready_reason()
        if reason:
            raise RequestError(f"model {name!r} not ready: {reason}", 503)
        return {"name": name, "ready": True}

    @app.post(
        "/v2/models/{model_name}/infer", response_model=InferResponse, response_model_exclude_none=True,
        responses=PREDICT_ERRORS, tags=["KServe v2"],
    )
    async def v2_infer(body: InferRequest, model_name: str = model_path) -> InferResponse:
        """Open inference protocol: the inputs' first dimension is the batch, split into instances."""
        check_model(model_name)
        bridge.admit()
        with bridge.metrics.request.time():
            instances = v2_instances(
                [tensor.model_dump() for tensor in body.inputs], bridge.signature,
                bridge.config.http.max_instances, bridge.config.limits.max_instance_bytes,
            )
            results = await bridge.infer(instances)
        wanted = [output.name for output in body.outputs] if body.outputs else None
        outputs = v2_outputs(results, bridge.signature.batched, wanted)
        return InferResponse(model_name=name, id=body.id, outputs=[InferTensor(**output) for output in outputs])


def drop_unused_422(app: FastAPI) -> None:
    """FastAPI documents 422 for every validated route; this bridge answers 400 instead."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for path in schema["paths"].values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def serve(config_path: str | None) -> int:
    """Runs the bridge in the foreground until SIGINT/SIGTERM; 2 on a set-up error."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    logging.getLogger("kafka").setLevel(logging.WARNING)
    try:
        config = load_config(config_path)
        bridge = Bridge(config)
        listener = listen(config.http.host, config.http.port)
        return asyncio.run(run_bridge(bridge, listener))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def listen(host: str, port: int) -> socket.socket:
    # IPPROTO_TCP named explicitly: asyncio turns Nagle's algorithm off only for sockets whose
    # proto says TCP, and accepted sockets inherit the listener's 0 otherwise. With Nagle on, a
    # response's body waited for the client's delayed ACK: 40 ms added to every request.
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        raise ConfigError(f"http.port: cannot listen on {host}:{port} ({exc})") from None
    listener.listen(2048)
    return listener


def server_config(bridge: Bridge) -> uvicorn.Config:
    """uvicorn serving the bridge's routes, with the protocol that answers unparsable requests."""
    return uvicorn.Config(
        create_app(bridge), http=json_error_protocol(bridge.metrics), log_level="warning", access_log=False, lifespan="off"
    )


async def run_bridge(bridge: Bridge, listener: socket.socket) -> int:
    """Connects to Kafka first, so the ready line means requests can be enqueued and answered."""
    await bridge.start()
    # uvicorn handles SIGINT/SIGTERM while it serves, then raises the signal again for the handler
    # below it: a no-op one, so the cleanup here finishes instead of being cancelled.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: None)
    try:
        server = uvicorn.Server(server_config(bridge))
        host, port = listener.getsockname()[:2]
        log.info("%shttp://%s:%d (model %r)", READY_LINE, host, port, bridge.model_name)
        await server.serve(sockets=[listener])
    finally:
        await bridge.stop()
    log.info("http bridge stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="client.http_bridge", description=__doc__.splitlines()[0])
    parser.add_argument("--config", "-c", help="config file (default: conf/config.yaml)")
    return serve(parser.parse_args(argv).config)


if __name__ == "__main__":
    sys.exit(main())
