"""Requests in an Open Inference Protocol encoding within a batch (wire/open_inference.py): one
such request holds a whole batch of instances, its inputs' first dimension, where our format holds
one. For a model with a batch dimension each is split into the rows the model runs with the batch's
other requests, and their outcomes are gathered back into one result per request."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from cluster_serving.runtime.outcomes import Outcome, Rows
from cluster_serving.wire.codec import Message
from cluster_serving.wire.open_inference import OipRequest, missing_output

log = logging.getLogger(__name__)

# Between a request's uri and a row's number in the uri of that row.
_ROW = "\x1f"


@dataclass
class SplitRequests:
    """Where each row came from: row uri -> (the request's uri, the row's number; None: the
    request whole, for a model without a batch dimension), and each request's number of rows."""

    owner: dict[str, tuple[str, int | None]] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)


def check_route(requests: list[Message], answers: dict[str, OipRequest], model: str, version: int
                ) -> tuple[list[Message], list[Message]]:
    """(the requests to serve, error results for OIP requests whose body names another model or
    version than the route served them by: the record's headers route, not the body)."""
    kept, refused = [], []
    for message in requests:
        request = answers.get(message.uri)
        named = request and (request.model_name not in ("", model) or request.model_version not in ("", str(version)))
        if not named:
            kept.append(message)
            continue
        refused.append(_refused(
            message.uri, f"the request names model {request.model_name or model!r} version"
            f" {request.model_version or version!r}, its record is routed to {model!r} version {version} (the record's"
            " model and version headers route a request; without them, the default model's newest version)"))
    return kept, refused


def _refused(uri: str, why: str, model: str | None = None, version: int | None = None) -> Message:
    log.warning("uri=%s bad request: %s", uri, why)
    return Message(uri, error=f"bad request: {why}", error_code="bad_request", model=model, model_version=version)


def split_rows(requests: list[Message], answers: dict[str, OipRequest], batched: bool
               ) -> tuple[list[Message], list[Message], SplitRequests]:
    """(the instances to serve, error results, where each came from): an OIP request to a model
    with a batch dimension as one instance per row of its inputs' common first dimension."""
    instances, refused, split = [], [], SplitRequests()
    for message in requests:
        if message.uri not in answers:
            instances.append(message)
        elif not batched:
            split.owner[message.uri], split.rows[message.uri] = (message.uri, None), 1
            instances.append(message)
        else:
            leading = {np.shape(value)[:1] for value in message.tensors.values()}
            if len(leading) != 1 or () in leading or leading == {(0,)}:
                refused.append(_refused(message.uri, "every input needs the same leading batch dimension, at least 1"))
                continue
            ((count,),) = leading
            split.rows[message.uri] = count
            for i in range(count):
                uri = message.uri if count == 1 else f"{message.uri}{_ROW}{i}"
                split.owner[uri] = (message.uri, i)
                instances.append(Message(uri, {name: value[i] for name, value in message.tensors.items()}))
    return instances, refused, split


def gather_rows(outcomes: list[Outcome], split: SplitRequests, answers: dict[str, OipRequest]) -> list[Outcome]:
    """The outcomes with each split request's rows gathered into its one result: the outputs
    stacked again (batch dimension first), or the first error among its rows, or a bad_request
    when it asked for an output the model has not."""
    if not split.owner:
        return outcomes
    kept: list[Outcome] = []
    parts: dict[str, dict[int | None, Message]] = {}
    for outcome in outcomes:
        if isinstance(outcome, Rows) and not any(uri in split.owner for uri in outcome.uris):
            kept.append(outcome)
            continue
        for message in outcome.messages() if isinstance(outcome, Rows) else [outcome]:
            owner = split.owner.get(message.uri)
            if owner is None:
                kept.append(message)
            else:
                parts.setdefault(owner[0], {})[owner[1]] = message
    for uri, rows in parts.items():
        result = _gathered(uri, rows, split.rows[uri])
        missing = missing_output(answers[uri], result) if result.error is None else None
        if missing is not None:
            result = _refused(uri, missing, result.model, result.model_version)
        kept.append(result)
    return kept


def _gathered(uri: str, rows: dict[int | None, Message], count: int) -> Message:
    first = next(iter(rows.values()))
    failed = next((message for message in rows.values() if message.error is not None), None)
    if failed is not None or len(rows) != count:
        error = failed.error if failed is not None else f"internal: {count - len(rows)} of {count} rows got no result"
        code = failed.error_code if failed is not None else "internal"
        return Message(uri, error=error, error_code=code, model=first.model, model_version=first.model_version)
    if None in rows:
        tensors = rows[None].tensors
    else:
        ordered = [rows[i] for i in range(count)]
        tensors = {name: np.asarray(first.tensors[name])[np.newaxis] if count == 1 else
                   np.stack([np.asarray(message.tensors[name]) for message in ordered]) for name in first.tensors}
    return Message(uri, tensors, batch_size=first.batch_size, inference_us=first.inference_us,
                   model=first.model, model_version=first.model_version)
