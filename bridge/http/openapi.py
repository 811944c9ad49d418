"""What the OpenAPI document at /openapi.json says beyond what FastAPI writes by itself: each
route's error statuses, taken from the error table so the document and the answers agree, and
the served model's name as the path's example, so generated requests (schemathesis) reach it."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Path
from pydantic import BaseModel

from bridge.dataplane import Bridge
from bridge.errors import HTTP_STATUS


class ErrorBody(BaseModel):
    error: str


def documented(*errors: type[Exception]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the statuses a route can answer with, named by the errors behind them."""
    return {HTTP_STATUS[error]: {"model": ErrorBody} for error in errors}


def model_path(bridge: Bridge) -> Any:
    """The `{model_name}` path parameter, the served name as its example."""
    return Path(examples=[bridge.model_name], description="the served model's name (model.name)")


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
