"""What the bridge refuses or fails at, named for what happened rather than for a transport, and
the one table of what each is in HTTP.

The core (`bridge.dataplane`), the JSON readers and the routers raise these; every HTTP answer to
one (the routers, the predict fast path, the ASGI guards, the OpenAPI document) takes its status
from `HTTP_STATUS`, so a status is decided here and nowhere else. A gRPC front would map the same
classes to its own status codes beside this table; the core never names either.
"""

from __future__ import annotations

from cluster_serving.wire.tensors import TensorError


class BridgeError(Exception):
    """A request the bridge refuses or could not serve; the message says why, for the client."""

    @property
    def status(self) -> int:
        """The HTTP status this error is answered with (see `HTTP_STATUS`)."""
        return http_status(self) or 500


class InvalidRequest(BridgeError):
    """The request is malformed or its values do not fit the model."""


class Unauthenticated(BridgeError):
    """The request lacks the credentials the bridge is configured to require."""


class ModelNotFound(BridgeError):
    """The request names a model this bridge does not serve."""


class TooLarge(BridgeError):
    """The request is over a size limit: body, instance count or instance bytes."""


class RateLimited(BridgeError):
    """The rate limit has no token left for this request."""


class InferenceFailed(BridgeError):
    """The job failed at its own end (inference, postprocessing, an unreadable result)."""


class NotReady(BridgeError):
    """Requests cannot be served now: Kafka or the job is not there."""


class Unavailable(BridgeError):
    """The request could not be handed to Kafka, or its model's queue was full (`overloaded`)."""


class Timeout(BridgeError):
    """No result came within the configured time."""


# TensorError is the connectors' ValueError for a value that is no tensor the model takes.
HTTP_STATUS: dict[type[Exception], int] = {
    InvalidRequest: 400,
    TensorError: 400,
    Unauthenticated: 401,
    ModelNotFound: 404,
    TooLarge: 413,
    RateLimited: 429,
    InferenceFailed: 500,
    NotReady: 503,
    Unavailable: 503,
    Timeout: 504,
}


# What the bridge raises for a job's error result, by its code (wire.ERROR_CODES).
RESULT_ERRORS: dict[str | None, type[BridgeError]] = {
    "bad_request": InvalidRequest,
    "too_large": TooLarge,
    "unknown_model": ModelNotFound,
    "unknown_version": ModelNotFound,
    "preprocess_failed": InvalidRequest,  # the servable's own check of the request's values
    "inference_failed": InferenceFailed,
    "postprocess_failed": InferenceFailed,
    "deadline_exceeded": Timeout,
    "overloaded": Unavailable,
    "internal": InferenceFailed,
}


def result_error(code: str | None) -> type[BridgeError]:
    """The error for a job's error result of this code; a code this build does not know (a newer
    job's) is the job's own failure."""
    return RESULT_ERRORS.get(code, InferenceFailed)


def http_status(exc: BaseException) -> int | None:
    """The HTTP status of an error the bridge expects; None for any other (a bug: a 500)."""
    return next((HTTP_STATUS[cls] for cls in type(exc).__mro__ if cls in HTTP_STATUS), None)

