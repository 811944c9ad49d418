"""The serving stage: a decoded micro-batch of one route -> its servable's results.

For a batch: resolve the route to a servable and version (job/servables.py), make the requests'
images and sparse tensors arrays as the servable says, run its preprocess function, its model (or
its pipeline's steps), its postprocess function and top-N, and tag every result with the model and
version that served it. For a control frame: adopt the routing table. Each request's problem is its
own error result; the batch's other requests are served.
"""

from __future__ import annotations

import gc
import logging
import time

from pyflink.datastream import MapFunction, RuntimeContext

from conf import ServingConfig
from conf.repository import PipelineStep, RoutingTable
from connectors.codec import Message
from job.decode import DecodedBatch, prepare_instances
from job.infer import Outcome, Rows, as_messages, predict
from job.postprocess import top_n
from job.preprocess import configure_pillow
from job.servables import RouteError, Served, Servables
from job.stages import apply_stage, run_pipeline

log = logging.getLogger(__name__)


class ServeBatch(MapFunction):
    def __init__(self, config: ServingConfig):
        self.config = config

    def open(self, runtime_context: RuntimeContext) -> None:
        configure_pillow(self.config.limits.max_image_pixels)
        self.servables = Servables(self.config)
        self.metrics = runtime_context.get_metrics_group().add_group("cluster_serving")
        self.batch_sizes = self.metrics.distribution("batchSize")
        self.inference_us = self.metrics.distribution("inferenceTimeUs")
        self.inference_errors = self.metrics.counter("inferenceErrors")
        self.per_version: dict[tuple[str, int], tuple] = {}
        # What is loaded by now (Flink's, Beam's, numpy's and ONNX Runtime's modules, the models)
        # lives as long as the job: frozen, Python's collector no longer walks it in each full
        # collection. Unfrozen, one took 66 ms at 45,000 req/s, and every request in flight waited.
        gc.freeze()

    def map(self, value: DecodedBatch) -> list[Outcome]:
        if value.table is not None:
            self._adopt(value.table)
            return []
        if not value.instances:
            return list(value.rejected)
        try:
            served, version = self.servables.resolve(value.model, value.version)
        except RouteError as exc:
            for message in value.instances:
                log.warning("uri=%s %s", message.uri, exc)
            return value.rejected + [Message(message.uri, error=str(exc)) for message in value.instances]
        started = time.perf_counter()
        outcomes = self.serve(served, version, value.instances)
        elapsed_us = int((time.perf_counter() - started) * 1_000_000)
        name = served.servable.name
        for outcome in outcomes:
            outcome.model, outcome.model_version = name, version
            if isinstance(outcome, Rows) or outcome.error is None:  # what the bridge reports as inference time
                outcome.inference_us = elapsed_us
        self._count(name, version, len(value.instances), elapsed_us, outcomes)
        return value.rejected + outcomes

    def _adopt(self, text: str) -> None:
        try:
            table = RoutingTable.parse(text)
        except ValueError:
            log.warning("a control frame without a routing table was ignored")
            return
        self.servables.adopt(table)

    def serve(self, served: Served, version: int, instances: list[Message]) -> list[Outcome]:
        settings = served.servable.config
        ready, errors = prepare_instances(instances, settings.preprocess.images, self.config.limits)
        ready, refused = apply_stage(served.preprocess, settings.preprocess.batched, ready, "preprocess")
        errors += refused
        if served.servable.is_pipeline:
            try:
                outcomes: list[Outcome] = list(run_pipeline(served.servable, self._serve_step, ready))
            except RouteError as exc:  # a step's model has no version open
                log.warning("pipeline %s: %s", served.servable.name, exc)
                outcomes = [Message(message.uri, error=f"pipeline {served.servable.name!r}: {exc}") for message in ready]
        else:
            outcomes = predict(served.models[version], ready, served.servable.batching.run_batch_size)
        if served.postprocess is not None or settings.postprocess.top_n:
            results, refused = apply_stage(served.postprocess, settings.postprocess.batched, as_messages(outcomes), "postprocess")
            errors += refused
            outcomes = [top_n(message, settings.postprocess.top_n) if settings.postprocess.top_n else message for message in results]
        return errors + outcomes

    def _serve_step(self, step: PipelineStep, feeds: list[Message]) -> list[Outcome]:
        served, version = self.servables.step(step.model, step.version)
        return self.serve(served, version, feeds)

    def _count(self, name: str, version: int, size: int, elapsed_us: int, outcomes: list[Outcome]) -> None:
        """The job's totals and the same per model and version (Flink UI: ...cluster_serving.model.<name>.version.<v>)."""
        failed = sum(1 for outcome in outcomes if isinstance(outcome, Message) and outcome.error)
        if (name, version) not in self.per_version:
            group = self.metrics.add_group("model", name).add_group("version", str(version))
            self.per_version[name, version] = (
                group.distribution("batchSize"), group.distribution("inferenceTimeUs"), group.counter("inferenceErrors")
            )
        for sizes, times, errors in (self.per_version[name, version], (self.batch_sizes, self.inference_us, self.inference_errors)):
            sizes.update(size)
            times.update(elapsed_us)
            errors.inc(failed)
