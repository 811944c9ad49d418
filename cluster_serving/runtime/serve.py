"""The serving core: a micro-batch of one route -> its servable's results, without Flink.

`BatchServer.serve_frame` is one batch's whole path, top to bottom: read the frame the JVM sends,
decode its records (in our format or an Open Inference Protocol encoding; those past their
deadline answered without running), resolve the route to a servable and version (servables.py),
split OIP requests into the rows the model runs (open_inference.py), make images and sparse
tensors arrays as the servable says, run its preprocess function, its model (or its
pipeline's steps), its postprocess function and top-N, tag every result with the model and version
that served it, gather each OIP request's rows again, and write the results' frame (OIP answers
in their encoding), with a dead letter for every request that failed. Each request's problem is
its own error result; the batch's other requests are served. The Flink job (job/operators.py) calls the same steps one
operator at a time, to count them in the Flink UI.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from cluster_serving.config import ServingConfig
from cluster_serving.runtime.dead_letters import dead_letters
from cluster_serving.runtime.decode import DecodedBatch, decode_frame, prepare_instances
from cluster_serving.runtime.encode import results_frame
from cluster_serving.runtime.infer import predict, predict_alike
from cluster_serving.runtime.model import OnnxModel
from cluster_serving.runtime.open_inference import SplitRequests, check_route, gather_rows, split_rows
from cluster_serving.runtime.outcomes import Outcome, Rows, as_messages, by_batch
from cluster_serving.runtime.postprocess import top_n
from cluster_serving.runtime.preprocess import configure_pillow
from cluster_serving.runtime.priority import at_process_niceness
from cluster_serving.runtime.repository import PipelineStep, RoutingTable
from cluster_serving.runtime.servables import RouteError, Servables, Served
from cluster_serving.runtime.stages import apply_stage, run_pipeline
from cluster_serving.wire.codec import Message

log = logging.getLogger(__name__)
# Image decoders where model.decode_threads is 0 (fewer on fewer cores): on a 16-core host, more
# threads waited longer for Python's lock between images than they gained.
DECODE_THREADS = 4


@dataclass
class Routed:
    """A batch and the servable and version its route resolved to: what runs on the model."""

    batch: DecodedBatch
    served: Served
    version: int

    @property
    def key(self) -> tuple[str, int]:
        return self.served.servable.name, self.version


@dataclass
class BatchStats:
    """What one served batch did, for metrics: its route, size, time in serve, and failures."""

    model: str
    version: int
    size: int
    elapsed_us: int
    failed: int
    # The batches it held: a frame of joined batches (job/batch.py) is served batch by batch.
    batches: int = 1


class BatchServer:
    """The models one subtask serves (opened as the routing table says) and the path of a batch
    through them."""

    def __init__(self, config: ServingConfig):
        self.config = config
        configure_pillow(config.limits.max_image_pixels)
        self.servables = Servables(config)
        # Started by whichever thread first decodes images, a lowered lane's among them: at the job's priority.
        threads = config.model.decode_threads or min(os.cpu_count() or 1, DECODE_THREADS)
        self.decode_pool = ThreadPoolExecutor(threads, "decode", initializer=at_process_niceness)

    def close(self) -> None:
        """Lets the decode threads go (they start with the first batch of images)."""
        self.decode_pool.shutdown(wait=False)

    def serve_frame(self, frame: bytes) -> bytes:
        """A frame of requests (or of a routing table) in, the frame of their results (and dead
        letters) out."""
        batch = decode_frame(frame, self.config.limits)
        outcomes, _ = self.serve_batch(batch)
        return results_frame(outcomes, dead_letters(batch, outcomes, self.config.kafka), batch.answers)

    def serve_batch(self, batch: DecodedBatch) -> tuple[list[Outcome], BatchStats | None]:
        """The batch's outcomes, and what it did (None when no model ran: a routing table adopted,
        nothing readable, or a route that names no open model)."""
        if batch.table is not None:
            self.adopt(batch.table)
            return [], None
        routed, answered = self.route(batch)
        return (answered, None) if routed is None else self.run(routed)

    def route(self, batch: DecodedBatch) -> tuple[Routed | None, list[Outcome]]:
        """The batch with the servable and version it goes to; or None and its outcomes when no
        model is to run it (nothing readable, or a route that names no open model)."""
        if not batch.instances and batch.alike is None:
            return None, list(batch.rejected)
        try:
            served, version = self.servables.resolve(batch.model, batch.version)
        except RouteError as exc:
            requests = batch.requests()
            for message in requests:
                log.warning("uri=%s %s", message.uri, exc)
            named = batch.model or None  # the model the requests asked for, which their answers name
            return None, batch.rejected + [Message(message.uri, error=str(exc), error_code=exc.code, model=named)
                                           for message in requests]
        return Routed(batch, served, version), []

    def run(self, routed: Routed) -> tuple[list[Outcome], BatchStats]:
        """A routed batch's outcomes (its rejected requests' among them) and what it did."""
        batch, served, version = routed.batch, routed.served, routed.version
        name, split, batching = served.servable.name, SplitRequests(), served.servable.batching
        # A frame of more than batch_size requests holds joined batches (job/batch.py), the last one
        # partial where they do not fill it: each is run as its own.
        batches = -(-batch.size // batching.batch_size)
        started = time.perf_counter()
        if batch.alike is not None and self.serves_whole(served, version):
            size = len(batch.alike)
            with served.pools[version].instance() as model:
                outcomes = predict_alike(model, batch.alike, batching.run_batch_size or batching.batch_size)
        else:
            requests, refused = check_route(batch.requests(), batch.answers, name, version)
            instances, invalid, split = split_rows(requests, batch.answers, self.takes_rows(served, version))
            size = len(instances)
            parts = [instances[at:at + batching.batch_size] for at in range(0, size, batching.batch_size)] if batches > 1 else [instances]
            outcomes = [outcome for part in parts for outcome in self.serve(served, version, part)] + refused + invalid
        elapsed_us = int((time.perf_counter() - started) * 1_000_000)
        for outcome in outcomes:
            outcome.model, outcome.model_version = name, version
            if isinstance(outcome, Rows) or outcome.error is None:  # what the bridge reports as inference time
                outcome.inference_us = elapsed_us // batches
        if batches > 1:
            outcomes = [part for outcome in outcomes for part in by_batch(outcome, batching.batch_size)]
        outcomes = gather_rows(outcomes, split, batch.answers)
        failed = sum(1 for outcome in outcomes if isinstance(outcome, Message) and outcome.error)
        return batch.rejected + outcomes, BatchStats(name, version, size, elapsed_us, failed, batches)

    def adopt(self, text: str) -> None:
        """Opens and closes models as a routing table's text says."""
        try:
            table = RoutingTable.parse(text)
        except ValueError:
            log.warning("a control frame without a routing table was ignored")
            return
        self.servables.adopt(table)

    def takes_rows(self, served: Served, version: int) -> bool:
        """Whether the servable's requests are rows of a batch (its model, or a pipeline's first
        step's, has a batch dimension): an OIP request is split into its rows then."""
        if not served.servable.is_pipeline:
            return served.pools[version].first.batched
        step = served.servable.config.steps[0]
        try:
            first, first_version = self.servables.step(step.model, step.version)
        except RouteError:  # the pipeline answers that itself
            return True
        return first.pools[first_version].first.batched

    @staticmethod
    def serves_whole(served: Served, version: int) -> bool:
        """Whether an alike batch goes to the model as it came, its inputs stacked already: a
        batched model with no functions or top-N around it."""
        settings = served.servable.config
        return (not served.servable.is_pipeline and served.preprocess is None and served.postprocess is None
                and not settings.postprocess.top_n and served.pools[version].first.batched)

    def serve(self, served: Served, version: int, instances: list[Message]) -> list[Outcome]:
        """The requests' outcomes, on a copy of the model no other thread runs meanwhile."""
        if served.servable.is_pipeline:
            return self._serve_on(served, None, instances)
        with served.pools[version].instance() as model:
            return self._serve_on(served, model, instances)

    def _serve_on(self, served: Served, model: OnnxModel | None, instances: list[Message]) -> list[Outcome]:
        settings = served.servable.config
        images = settings.preprocess.images if model is None else model.images  # the model's: plain pixels on a GPU
        ready, errors = prepare_instances(
            instances, images, self.config.limits, self.decode_pool, model.batch_array if model is not None else None
        )
        ready, refused = apply_stage(served.preprocess, settings.preprocess.batched, ready, "preprocess")
        errors += refused
        if served.servable.is_pipeline:
            try:
                outcomes: list[Outcome] = list(run_pipeline(served.servable, self._serve_step, ready))
            except RouteError as exc:  # a step's model has no version open
                log.warning("pipeline %s: %s", served.servable.name, exc)
                outcomes = [Message(message.uri, error=f"pipeline {served.servable.name!r}: {exc}", error_code=exc.code) for message in ready]
        else:
            outcomes = predict(model, ready, served.servable.batching.run_batch_size)
        if served.postprocess is not None or settings.postprocess.top_n:
            results, refused = apply_stage(served.postprocess, settings.postprocess.batched, as_messages(outcomes), "postprocess")
            errors += refused
            outcomes = [top_n(message, settings.postprocess.top_n) if settings.postprocess.top_n else message for message in results]
        return errors + outcomes

    def _serve_step(self, step: PipelineStep, feeds: list[Message]) -> list[Outcome]:
        served, version = self.servables.step(step.model, step.version)
        return self.serve(served, version, feeds)
