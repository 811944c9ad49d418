"""KServe's v2 protocol (the open inference protocol) over HTTP/JSON: server and model metadata,
health and readiness, and /infer, whose inputs' first dimension is the batch, split into
instances and stacked back into output tensors (`bridge.http_json`); each model route also per
version (`/v2/models/<name>/versions/<v>/...`). Besides: the repository's models (`GET /v2/models`)
and the model repository extension's index (`POST /v2/repository/index`, Triton's and KServe's)."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any

import numpy as np
from fastapi import FastAPI
from pydantic import BaseModel, Field, PrivateAttr

from cluster_serving.http.asgi.binary_tensors import BinaryAnswer, with_binary_values
from cluster_serving.http.asgi.fast_path import predict_route
from cluster_serving.http.asgi.openapi import documented, model_path, version_path
from cluster_serving.http.catalog import Target, platform
from cluster_serving.http.dataplane import Bridge
from cluster_serving.http.errors import ModelNotFound, NotReady, Unauthenticated
from cluster_serving.http.json_tensors import v2_instances, v2_json_output, v2_output_arrays
from cluster_serving.runtime.signature import tensor_metadata
from cluster_serving.wire.codec import MAX_RANK
from cluster_serving.wire.tensors import raw_bytes, v2_datatype

TAGS: list[str | Enum] = ["KServe v2"]


class InferTensor(BaseModel):
    name: str
    shape: list[Annotated[int, Field(ge=0, strict=True)]] = Field(max_length=MAX_RANK)
    datatype: str
    # Absent for a tensor sent as binary data (parameters.binary_data_size).
    data: list[Any] | None = None
    parameters: dict[str, Any] | None = None


class RequestedOutput(BaseModel):
    name: str
    parameters: dict[str, Any] | None = None


class InferRequest(BaseModel):
    id: str | None = None
    inputs: list[InferTensor] = Field(min_length=1)
    outputs: list[RequestedOutput] | None = None
    parameters: dict[str, Any] | None = None
    # The body's bytes after its JSON part (the binary tensor data extension).
    _binary: bytes = PrivateAttr(b"")


class InferResponse(BaseModel):
    model_name: str
    # The version that served the request (the one it named, where the job does not say).
    model_version: str | None = None
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


class ModelEntry(BaseModel):
    name: str
    versions: list[str]
    platform: str


class IndexEntry(BaseModel):
    name: str
    version: str
    state: str
    reason: str | None = None


async def described(bridge: Bridge, model_name: str, model_version: str | None) -> Target:
    """The target of a metadata or readiness request, from a reading at most a second old."""
    await bridge.catalog.refresh()
    return await bridge.target(model_name, model_version)


def model_metadata(bridge: Bridge, target: Target) -> ModelMetadata:
    """The model's versions, and the signature of the version asked for (else of the newest)."""
    servable = bridge.catalog.reading.servables[target.model]
    signature = target.signature
    return ModelMetadata(
        name=target.model, versions=[str(version) for version in servable.versions], platform=platform(servable),
        inputs=[TensorMetadata(**tensor_metadata(info)) for info in signature.inputs],
        outputs=[TensorMetadata(**tensor_metadata(info)) for info in signature.outputs],
    )


async def model_ready(bridge: Bridge, target: Target) -> dict[str, Any]:
    reason = await bridge.not_ready_reason()
    if reason:
        raise NotReady(f"model {target.model!r} not ready: {reason}")
    version = {} if target.version is None else {"version": str(target.version)}
    return {"name": target.model, **version, "ready": True}


async def infer(bridge: Bridge, target: Target, body: InferRequest) -> dict[str, Any] | BinaryAnswer:
    """The request's tensors read as instances (one per row of the batch), their results as tensors:
    JSON values, or binary data where the request asks for it."""
    results = await bridge.predict(target, lambda: read_inputs(bridge, target, body))
    wanted = [output.name for output in body.outputs] if body.outputs else None
    arrays = v2_output_arrays(results, target.signature.batched, wanted)
    binary = binary_outputs(body, list(arrays))
    outputs, chunks = [], []
    for name, array in arrays.items():
        if name in binary:
            chunks.append(raw_bytes(array))
            outputs.append({"name": name, "shape": list(array.shape), "datatype": v2_datatype(array),
                            "parameters": {"binary_data_size": len(chunks[-1])}})
        else:
            outputs.append(v2_json_output(name, array))
    first = results[0]
    version = first.model_version if first.model_version is not None else target.version
    answer = {
        "model_name": first.model or target.model,
        **({"model_version": str(version)} if version is not None else {}),
        **({"id": body.id} if body.id is not None else {}),
        "outputs": outputs,
    }
    return BinaryAnswer(answer, chunks) if chunks else answer


def binary_outputs(body: InferRequest, names: list[str]) -> set[str]:
    """The outputs to send as binary data: all with the request's binary_data_output, else those
    whose requested output says binary_data."""
    if (body.parameters or {}).get("binary_data_output") is True:
        return set(names)
    return {output.name for output in body.outputs or [] if (output.parameters or {}).get("binary_data") is True}


def read_inputs(bridge: Bridge, target: Target, body: InferRequest) -> list[dict[str, np.ndarray]]:
    config = bridge.config
    inputs = with_binary_values([tensor.model_dump() for tensor in body.inputs], body._binary)
    return v2_instances(
        inputs, target.signature,
        config.http.max_instances, config.limits.max_instance_bytes,
    )


def register(app: FastAPI, bridge: Bridge) -> None:
    """Adds the v2 routes over `bridge` to `app`."""
    name, version = model_path(bridge), version_path(bridge)
    model_errors = documented(Unauthenticated, ModelNotFound)
    ready_errors = documented(Unauthenticated, ModelNotFound, NotReady)

    @app.get("/v2", responses=documented(Unauthenticated), tags=TAGS)
    async def v2_server() -> dict[str, Any]:
        return {"name": "cluster-serving", "version": app.version, "extensions": ["binary_tensor_data"]}

    @app.get("/v2/health/live", tags=TAGS)
    async def live() -> dict[str, bool]:
        return {"live": True}

    @app.get("/v2/health/ready", responses=documented(NotReady), tags=TAGS)
    async def ready() -> dict[str, bool]:
        await bridge.require_ready()
        return {"ready": True}

    @app.get("/v2/models", response_model=list[ModelEntry], responses=documented(Unauthenticated), tags=TAGS)
    async def v2_models() -> list[dict[str, Any]]:
        """The repository's models, each with the versions it serves."""
        reading = await bridge.catalog.refresh()
        return [
            {"name": servable.name, "versions": [str(v) for v in servable.versions], "platform": platform(servable)}
            for _, servable in sorted(reading.servables.items())
        ]

    @app.post("/v2/repository/index", response_model=list[IndexEntry], response_model_exclude_none=True,
              responses=documented(Unauthenticated), tags=TAGS)
    async def v2_repository_index() -> list[dict[str, str]]:
        """The model repository extension's index: every version, READY or UNAVAILABLE with a reason."""
        await bridge.catalog.refresh()
        return bridge.catalog.index()

    @app.get("/v2/models/{model_name}", response_model=ModelMetadata, responses=model_errors, tags=TAGS)
    async def v2_metadata(model_name: str = name) -> ModelMetadata:
        return model_metadata(bridge, await described(bridge, model_name, None))

    @app.get("/v2/models/{model_name}/versions/{model_version}", response_model=ModelMetadata,
             responses=model_errors, tags=TAGS)
    async def v2_version_metadata(model_name: str = name, model_version: str = version) -> ModelMetadata:
        return model_metadata(bridge, await described(bridge, model_name, model_version))

    @app.get("/v2/models/{model_name}/ready", responses=ready_errors, tags=TAGS)
    async def v2_model_ready(model_name: str = name) -> dict[str, Any]:
        return await model_ready(bridge, await described(bridge, model_name, None))

    @app.get("/v2/models/{model_name}/versions/{model_version}/ready", responses=ready_errors, tags=TAGS)
    async def v2_version_ready(model_name: str = name, model_version: str = version) -> dict[str, Any]:
        return await model_ready(bridge, await described(bridge, model_name, model_version))

    @predict_route(app, "/v2/models/{model_name}/infer", response_model=InferResponse, tags=TAGS)
    async def v2_infer(body: InferRequest, model_name: str = name) -> dict[str, Any] | BinaryAnswer:
        """Open inference protocol: the inputs' first dimension is the batch, split into instances;
        served by the newest version the job serves."""
        return await infer(bridge, await bridge.target(model_name), body)

    @predict_route(app, "/v2/models/{model_name}/versions/{model_version}/infer", response_model=InferResponse, tags=TAGS)
    async def v2_version_infer(
        body: InferRequest, model_name: str = name, model_version: str = version
    ) -> dict[str, Any] | BinaryAnswer:
        """Open inference protocol, served by the version named."""
        return await infer(bridge, await bridge.target(model_name, model_version), body)
