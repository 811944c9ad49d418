"""Inference: runs a decoded micro-batch through ONNX Runtime, one stacked run per input shape.

A request that does not fit the model, or a group whose run raises, gets an error outcome; the
others in the batch still get their results.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pyflink.datastream import MapFunction, RuntimeContext

from conf import ModelConfig, PostprocessConfig
from connectors.codec import Message
from job.decode import DecodedBatch, error_result
from job.model import InvalidInput, OnnxModel
from job.postprocess import top_n

log = logging.getLogger(__name__)
Feed = dict[str, np.ndarray]


@dataclass
class Rows:
    """The results of one stacked run: row i of every output belongs to uris[i]. Kept stacked so
    that the encoder writes them without splitting them into per-request dicts."""

    uris: list[str]
    outputs: dict[str, np.ndarray]
    inference_us: int | None = None

    def messages(self) -> list[Message]:
        return [
            Message(uri, {name: value[i] for name, value in self.outputs.items()}, batch_size=len(self.uris),
                    inference_us=self.inference_us)
            for i, uri in enumerate(self.uris)
        ]


Outcome = Message | Rows


def as_messages(outcomes: list[Outcome]) -> list[Message]:
    """One message per request: what postprocessing and tests read."""
    return [message for outcome in outcomes for message in (outcome.messages() if isinstance(outcome, Rows) else [outcome])]


def signature(feed: Feed) -> tuple:
    """Instances with equal signatures can be stacked into one run."""
    return tuple((name, value.shape, value.dtype.str) for name, value in feed.items())


def predict(model: OnnxModel, instances: list[Message]) -> list[Outcome]:
    """The outcomes of a batch's requests, in no particular order. Requests in format v2 with the
    same layout have the same names, dtypes and shapes: the first is checked for all of them."""
    outcomes: list[Outcome] = []
    groups: dict[object, list[tuple[str, Feed]]] = {}
    verdicts: dict[bytes, Exception | None] = {}  # layout -> why it does not fit the model, or None
    casting: set[bytes] = set()  # layouts whose dtypes the model casts: values checked per request
    for instance in instances:
        key = instance.layout_key
        if key is not None and key in verdicts:
            problem = verdicts[key] or (_out_of_range(model, instance.tensors) if key in casting else None)
            if problem is not None:
                outcomes.append(error_result(instance.uri, "invalid input", problem))
            else:
                groups[key].append((instance.uri, instance.tensors))
            continue
        try:
            feed = model.prepare(instance.tensors)
        except Exception as exc:  # InvalidInput, or one no check foresaw: this request's alone
            if key is not None:
                verdicts[key] = exc
            outcomes.append(error_result(instance.uri, "invalid input", exc))
            continue
        if key is not None:
            verdicts[key] = None
            if model.casts(instance.tensors):
                casting.add(key)
        groups.setdefault(key if key is not None else signature(feed), []).append((instance.uri, feed))
    for group in groups.values():
        outcomes.extend(_run_group(model, group))
    return outcomes


def _out_of_range(model: OnnxModel, tensors: Feed) -> Exception | None:
    try:
        model.check_values(tensors)
    except InvalidInput as exc:
        return exc
    return None


def _run_group(model: OnnxModel, group: list[tuple[str, Feed]]) -> list[Outcome]:
    try:
        if not model.batched:
            return [Message(uri, tensors=model.run_one(feed), batch_size=1) for uri, feed in group]
        return [Rows([uri for uri, _ in group], model.run_stacked([feed for _, feed in group]))]
    except Exception as exc:
        if len(group) > 1:
            # Find the instance that broke the run; its neighbours still get results.
            return [outcome for member in group for outcome in _run_group(model, [member])]
        log.warning("uri=%s inference failed: %s", group[0][0], exc)
        return [Message(uri=group[0][0], error=f"inference failed: {exc}")]


class InferBatch(MapFunction):
    """The Flink stage: opens one ONNX Runtime session per subtask, reports batch metrics and
    applies the configured postprocessing."""

    def __init__(self, model: ModelConfig, device: str, postprocess: PostprocessConfig):
        self.model_config = model
        self.device = device
        self.top_n = postprocess.top_n

    def open(self, runtime_context: RuntimeContext) -> None:
        config = self.model_config
        self.model = OnnxModel(Path(config.path), self.device, config.inputs, config.outputs, config.threads)
        log.info("opened %s on %s (batched runs: %s)", config.path, self.model.provider, self.model.batched)
        group = runtime_context.get_metrics_group().add_group("cluster_serving")
        self.batch_sizes = group.distribution("batchSize")
        self.inference_us = group.distribution("inferenceTimeUs")
        self.inference_errors = group.counter("inferenceErrors")

    def map(self, value: DecodedBatch) -> list[Outcome]:
        started = time.perf_counter()
        outcomes = predict(self.model, value.instances)
        if value.instances:
            elapsed_us = int((time.perf_counter() - started) * 1_000_000)
            self.batch_sizes.update(len(value.instances))
            self.inference_us.update(elapsed_us)
            for outcome in outcomes:  # what the HTTP bridge reports as the job's inference time
                if isinstance(outcome, Rows) or outcome.error is None:
                    outcome.inference_us = elapsed_us
        if self.top_n:
            outcomes = [top_n(message, self.top_n) for message in as_messages(outcomes)]
        self.inference_errors.inc(sum(1 for outcome in outcomes if isinstance(outcome, Message) and outcome.error))
        return value.rejected + outcomes
