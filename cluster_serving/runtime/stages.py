"""What a servable does around its model: its stage functions, and the steps of a pipeline.

Pure functions over decoded requests, testable without Flink. A stage function comes from the
servable's servable.py (cluster_serving/runtime/repository.py); whatever it raises is that request's error result,
never a restart of the job. Pipelines run their steps one after another on the whole micro-batch,
each step served as its model serves its own requests (its stages, one stacked run), the
intermediate tensors kept here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from cluster_serving.runtime.outcomes import InvalidInput, Outcome, as_messages, error_result
from cluster_serving.runtime.repository import PipelineStep, Servable
from cluster_serving.wire.codec import Message

Tensors = dict[str, np.ndarray]


class StageError(ValueError):
    """A stage function returned something that is not a result: a name -> array mapping per instance."""


def apply_stage(
    function: Callable[..., Any] | None, batched: bool, messages: list[Message], kind: str
) -> tuple[list[Message], list[Message]]:
    """(messages with the stage's output as tensors, error results). A batched function that raises
    is called again one instance at a time, so that only the instances it fails on get errors."""
    if function is None or not messages:
        return messages, []
    if batched and len(messages) > 1:
        try:
            outputs = _called(function, True, [message.tensors for message in messages], kind)
            return [_with(message, output) for message, output in zip(messages, outputs)], []
        except Exception:
            pass
    kept: list[Message] = []
    errors: list[Message] = []
    for message in messages:
        try:
            kept.append(_with(message, _called(function, batched, [message.tensors], kind)[0]))
        except Exception as exc:
            errors.append(error_result(message.uri, f"{kind} failed", _as_reported(exc), f"{kind}_failed"))
    return kept, errors


def _called(function: Callable[..., Any], batched: bool, inputs: list[Tensors], kind: str) -> list[Tensors]:
    """The function's outputs for `inputs`, checked: one name -> array mapping per instance."""
    outputs = function(inputs) if batched else [function(inputs[0])]
    if not isinstance(outputs, list) or len(outputs) != len(inputs):
        raise StageError(f"a batched {kind} must return a list of {len(inputs)} results, got {type(outputs).__name__}")
    return [_tensors(output, kind) for output in outputs]


def _with(message: Message, tensors: Tensors) -> Message:
    return Message(message.uri, tensors, message.error, message.batch_size, message.inference_us)


def _tensors(output: Any, kind: str) -> Tensors:
    if not isinstance(output, dict) or not all(isinstance(name, str) for name in output):
        raise StageError(f"{kind} must return a dict of name -> array, got {type(output).__name__}")
    return {name: np.asarray(value) for name, value in output.items()}


def _as_reported(exc: Exception) -> Exception:
    """A user's stage raising is expected: its message, with its type, is the result's error."""
    return exc if isinstance(exc, StageError) else InvalidInput(f"{type(exc).__name__}: {exc}")


# Serves one step's requests as the step's model serves its own (its stages, its model): the
# serving stage's `serve`, for the servable and version the step names.
ServeStep = Callable[[PipelineStep, list[Message]], list[Outcome]]


def run_pipeline(servable: Servable, serve_step: ServeStep, instances: list[Message]) -> list[Message]:
    """One result per instance: the last step's outputs (or the servable's `outputs`), or the error
    of the step that failed it. Each step runs once on the whole batch."""
    values: dict[str, dict[str, Tensors]] = {message.uri: {"": message.tensors} for message in instances}
    alive = [message.uri for message in instances]
    errors: list[Message] = []
    previous = ""
    for index, step in enumerate(servable.config.steps):
        feeds, refused = _step_feeds(step, index, previous, alive, values)
        errors += refused
        alive = []
        for result in as_messages(serve_step(step, feeds)):
            if result.error is not None:
                errors.append(Message(result.uri, error=f"step {step.step_name!r}: {result.error}", error_code=result.error_code))
            else:
                values[result.uri][step.step_name] = result.tensors
                alive.append(result.uri)
        previous = step.step_name
    wanted = servable.config.outputs
    results = [
        Message(uri, {name: value for name, value in values[uri][previous].items() if not wanted or name in wanted})
        for uri in alive
    ]
    return errors + results


def _step_feeds(
    step: PipelineStep, index: int, previous: str, uris: list[str], values: dict[str, dict[str, Tensors]]
) -> tuple[list[Message], list[Message]]:
    """A step's inputs per request, from the request's tensors or earlier steps' outputs."""
    feeds, refused = [], []
    for uri in uris:
        known = values[uri]
        try:
            if step.inputs:
                feed = {name: _source(source, known) for name, source in step.inputs.items()}
            else:
                feed = dict(known[previous] if index else known[""])
        except KeyError as exc:
            refused.append(error_result(uri, f"step {step.step_name!r}", InvalidInput(f"no tensor {exc.args[0]!r}")))
            continue
        feeds.append(Message(uri, feed))
    return feeds, refused


def _source(source: str, known: dict[str, Tensors]) -> np.ndarray:
    """'<step>.<output>' of an earlier step, else a request input's name."""
    step, _, output = source.partition(".")
    if output and step in known:
        if output not in known[step]:
            raise KeyError(source)
        return known[step][output]
    if source not in known[""]:
        raise KeyError(source)
    return known[""][source]
