"""BigDL Cluster Serving's own HTTP routes: POST /predict (KServe v1's instances and predictions,
without a model name: the repository's default model, its newest version) and the metrics, as
Dropwizard-style JSON (the BigDL guide's) and as Prometheus text."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from cluster_serving.http.asgi.fast_path import predict_route
from cluster_serving.http.asgi.openapi import documented
from cluster_serving.http.dataplane import Bridge
from cluster_serving.http.errors import Unauthenticated
from cluster_serving.http.protocol.kserve_v1 import PredictRequest, PredictResponse, predict_instances


def register(app: FastAPI, bridge: Bridge) -> None:
    """Adds BigDL's routes over `bridge` to `app`."""

    @predict_route(app, "/predict", response_model=PredictResponse, tags=["BigDL"])
    async def predict(body: PredictRequest) -> dict[str, list[Any]]:
        """BigDL Cluster Serving's predict: one prediction per instance, in order."""
        return await predict_instances(bridge, await bridge.target(), body)

    @app.get("/metrics", responses=documented(Unauthenticated), tags=["metrics"])
    async def metrics() -> list[dict[str, Any]]:
        """Dropwizard-style JSON: timers in milliseconds, counters."""
        return bridge.metrics.dropwizard()

    @app.get(
        "/metrics/prometheus", response_class=PlainTextResponse, responses=documented(Unauthenticated), tags=["metrics"]
    )
    async def metrics_prometheus() -> str:
        """The same metrics in Prometheus' text format."""
        return bridge.metrics.prometheus()
