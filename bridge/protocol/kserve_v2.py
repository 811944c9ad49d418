"""KServe's v2 protocol (the open inference protocol) over HTTP/JSON: server and model metadata,
health and readiness, and /infer, whose inputs' first dimension is the batch, split into
instances and stacked back into output tensors (`bridge.http_json`)."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any

from fastapi import FastAPI
import numpy as np
from pydantic import BaseModel, Field, PrivateAttr

from bridge.dataplane import Bridge
from bridge.errors import ModelNotFound, NotReady, Unauthenticated
from bridge.http.fast_path import predict_route
from bridge.http.openapi import documented, model_path
from bridge.http.binary_tensors import BinaryAnswer, values_to_bytes, with_binary_values
from bridge.http_json import v2_datatype, v2_instances, v2_json_output, v2_output_arrays
from bridge.model_info import tensor_metadata
from connectors.codec import MAX_RANK

PLATFORM = "onnxruntime_onnx"
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


def model_metadata(bridge: Bridge) -> ModelMetadata:
    signature = bridge.signature
    return ModelMetadata(
        name=bridge.model_name, versions=["1"], platform=PLATFORM,
        inputs=[TensorMetadata(**tensor_metadata(info)) for info in signature.inputs],
        outputs=[TensorMetadata(**tensor_metadata(info)) for info in signature.outputs],
    )


async def infer(bridge: Bridge, body: InferRequest) -> dict[str, Any] | BinaryAnswer:
    """The request's tensors read as instances (one per row of the batch), their results as tensors:
    JSON values, or binary data where the request asks for it."""
    results = await bridge.predict(lambda: read_inputs(bridge, body))
    wanted = [output.name for output in body.outputs] if body.outputs else None
    arrays = v2_output_arrays(results, bridge.signature.batched, wanted)
    binary = binary_outputs(body, list(arrays))
    outputs, chunks = [], []
    for name, array in arrays.items():
        if name in binary:
            chunks.append(values_to_bytes(array))
            outputs.append({"name": name, "shape": list(array.shape), "datatype": v2_datatype(array),
                            "parameters": {"binary_data_size": len(chunks[-1])}})
        else:
            outputs.append(v2_json_output(name, array))
    answer = {"model_name": bridge.model_name, **({"id": body.id} if body.id is not None else {}), "outputs": outputs}
    return BinaryAnswer(answer, chunks) if chunks else answer


def binary_outputs(body: InferRequest, names: list[str]) -> set[str]:
    """The outputs to send as binary data: all with the request's binary_data_output, else those
    whose requested output says binary_data."""
    if (body.parameters or {}).get("binary_data_output") is True:
        return set(names)
    return {output.name for output in body.outputs or [] if (output.parameters or {}).get("binary_data") is True}


def read_inputs(bridge: Bridge, body: InferRequest) -> list[dict[str, np.ndarray]]:
    config = bridge.config
    inputs = with_binary_values([tensor.model_dump() for tensor in body.inputs], body._binary)
    return v2_instances(
        inputs, bridge.signature,
        config.http.max_instances, config.limits.max_instance_bytes,
    )


def register(app: FastAPI, bridge: Bridge) -> None:
    """Adds the v2 routes over `bridge` to `app`."""
    name = model_path(bridge)
    model_errors = documented(Unauthenticated, ModelNotFound)

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

    @app.get("/v2/models/{model_name}", response_model=ModelMetadata, responses=model_errors, tags=TAGS)
    async def v2_metadata(model_name: str = name) -> ModelMetadata:
        bridge.check_model(model_name)
        return model_metadata(bridge)

    @app.get("/v2/models/{model_name}/ready", responses=documented(Unauthenticated, ModelNotFound, NotReady), tags=TAGS)
    async def v2_model_ready(model_name: str = name) -> dict[str, Any]:
        bridge.check_model(model_name)
        reason = await bridge.not_ready_reason()
        if reason:
            raise NotReady(f"model {bridge.model_name!r} not ready: {reason}")
        return {"name": bridge.model_name, "ready": True}

    @predict_route(app, "/v2/models/{model_name}/infer", response_model=InferResponse, tags=TAGS)
    async def v2_infer(body: InferRequest, model_name: str = name) -> dict[str, Any] | BinaryAnswer:
        """Open inference protocol: the inputs' first dimension is the batch, split into instances."""
        bridge.check_model(model_name)
        return await infer(bridge, body)
