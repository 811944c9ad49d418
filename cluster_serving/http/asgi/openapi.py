"""What the OpenAPI document at /openapi.json says beyond what FastAPI writes by itself: each
route's error statuses, taken from the error table so the document and the answers agree, and
the default model's name and newest version as the paths' examples, so generated requests
(schemathesis) reach them."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Path
from pydantic import BaseModel

from cluster_serving.http.dataplane import Bridge
from cluster_serving.http.errors import HTTP_STATUS


class ErrorBody(BaseModel):
    error: str


def documented(*errors: type[Exception]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the statuses a route can answer with, named by the errors behind them."""
    return {HTTP_STATUS[error]: {"model": ErrorBody} for error in errors}


def model_path(bridge: Bridge) -> Any:
    """The `{model_name}` path parameter, the default model's name as its example."""
    return Path(examples=[bridge.model_name], description="a model the repository serves (GET /v2/models lists them)")


def version_path(bridge: Bridge) -> Any:
    """The `{model_version}` path parameter, the default model's newest version as its example."""
    versions = bridge.catalog.reading.servables[bridge.model_name].versions
    return Path(examples=[str(versions[-1])], description="a version the model serves (a positive integer)")


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
