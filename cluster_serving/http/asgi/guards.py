"""The ASGI layers around the routes: the body-size limit, the bearer token, the response counter.
Their refusals are `bridge.errors`, answered by the error table like any other."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster_serving.http.asgi.responses import exception_response
from cluster_serving.http.errors import TooLarge, Unauthenticated
from cluster_serving.http.metrics import BridgeMetrics

OPEN_ROUTES = ("/v2/health/",)  # reachable without the bearer token: liveness/readiness probes


def header(scope: Scope, name: bytes) -> bytes | None:
    """The value of the request's header `name` (lower case), None when it has none."""
    return next((value for key, value in scope["headers"] if key == name), None)


class BodyLimit:
    """Refuses bodies over `max_bytes`, declared or streamed, before anything parses them."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = header(scope, b"content-length")
        if declared is None:  # no Content-Length (chunked): counted as it streams in
            return await self.app(scope, self._limited(receive), send)
        if not declared.isdigit() or int(declared) > self.max_bytes:
            return await exception_response(self._too_large(), scope)(scope, receive, send)
        await self.app(scope, receive, send)  # the HTTP parser delivers no more than declared

    def _too_large(self) -> TooLarge:
        return TooLarge(f"request body over the limit of {self.max_bytes} bytes")

    def _limited(self, receive: Receive) -> Receive:
        """`receive`, raising TooLarge (for whoever reads the body to answer) past the limit."""
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise self._too_large()
            return message

        return limited


class BearerToken:
    """Refuses requests without `Authorization: Bearer <token>`; health probes are open."""

    def __init__(self, app: ASGIApp, token: str):
        self.app, self.expected = app, f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not scope["path"].startswith(OPEN_ROUTES):
            if not hmac.compare_digest(header(scope, b"authorization") or b"", self.expected):
                refused = Unauthenticated("missing or wrong bearer token")
                return await exception_response(refused, scope)(scope, receive, send)
        await self.app(scope, receive, send)


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
