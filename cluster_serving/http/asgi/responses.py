"""Every HTTP error answer of the bridge: `{"error": "<message>"}`, with the status the error table
(`bridge.errors.HTTP_STATUS`) gives the exception, whichever path (router, fast path, guard) met it."""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse
from starlette.types import Scope, Send

from cluster_serving.http.errors import http_status

log = logging.getLogger("cluster_serving.http")


def error_response(status: int, message: str) -> JSONResponse:
    """The JSON error; a 401 also names the scheme it wants, as HTTP asks."""
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def exception_response(exc: BaseException, scope: Scope) -> JSONResponse:
    """The answer to `exc`: its status by the error table; an exception nobody expected is a 500,
    logged with its traceback."""
    status = http_status(exc)
    if status is None:
        log.exception("%s %s failed", scope["method"], scope["path"], exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
    return error_response(status, str(exc))


async def send_json(send: Send, body: bytes) -> None:
    """A 200 with the JSON `body`, as the two ASGI messages themselves."""
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})
