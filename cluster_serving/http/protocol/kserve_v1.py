"""KServe's v1 protocol (TensorFlow Serving's): `{"instances": [...]}` in, `{"predictions": [...]}`
out, one prediction per instance, in order; and the model list and model health routes. TensorFlow
Serving's routes name no version: a v1 request is served by the newest version the job serves."""

from __future__ import annotations

from enum import Enum
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, Field

from cluster_serving.http.asgi.fast_path import predict_route
from cluster_serving.http.asgi.openapi import documented, model_path
from cluster_serving.http.catalog import Target
from cluster_serving.http.dataplane import Bridge
from cluster_serving.http.errors import ModelNotFound, Unauthenticated
from cluster_serving.http.json_tensors import prediction, read_instances

TAGS: list[str | Enum] = ["KServe v1"]


class PredictRequest(BaseModel):
    instances: list[dict[str, Any]] = Field(min_length=1, description="one object of input name -> value per instance")


class PredictResponse(BaseModel):
    predictions: list[Any]


async def predict_instances(bridge: Bridge, target: Target, body: PredictRequest) -> dict[str, list[Any]]:
    """The predictions for `body`'s instances (BigDL's /predict answers the same way)."""
    instances = body.instances
    results = await bridge.predict(
        target, lambda: read_instances(instances, target.signature, target.image_inputs), count=len(instances)
    )
    return {"predictions": [prediction(result) for result in results]}


def register(app: FastAPI, bridge: Bridge) -> None:
    """Adds the v1 routes over `bridge` to `app`."""
    name = model_path(bridge)

    @app.get("/v1/models", responses=documented(Unauthenticated), tags=TAGS)
    async def v1_models() -> dict[str, list[str]]:
        """The repository's model names."""
        return {"models": sorted((await bridge.catalog.refresh()).servables)}

    @app.get("/v1/models/{model_name}", responses=documented(Unauthenticated, ModelNotFound), tags=TAGS)
    async def v1_model(model_name: str = name) -> dict[str, Any]:
        await bridge.catalog.refresh()
        target = await bridge.target(model_name)
        return {"name": target.model, "ready": await bridge.not_ready_reason() is None}

    @predict_route(app, "/v1/models/{model_name}:predict", response_model=PredictResponse, tags=TAGS)
    async def v1_predict(body: PredictRequest, model_name: str = name) -> dict[str, list[Any]]:
        return await predict_instances(bridge, await bridge.target(model_name), body)
