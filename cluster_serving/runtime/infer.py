"""Inference: runs a decoded micro-batch through one ONNX Runtime model, one stacked run per input shape.

A request that does not fit the model, or a group whose run raises, gets an error outcome; the
others in the batch still get their results.
"""

from __future__ import annotations

import logging

import numpy as np

from cluster_serving.runtime.decode import AlikeRequests
from cluster_serving.runtime.model import OnnxModel
from cluster_serving.runtime.outcomes import InvalidInput, Outcome, Rows, error_result
from cluster_serving.wire.codec import Message

log = logging.getLogger(__name__)
Feed = dict[str, np.ndarray]
# The request layouts a model remembers as fitting it (OnnxModel.fitting_layouts): a stream repeats a few.
MAX_FITTING_LAYOUTS = 64


def signature(feed: Feed) -> tuple:
    """Instances with equal signatures can be stacked into one run."""
    return tuple((name, value.shape, value.dtype.str) for name, value in feed.items())


def predict(model: OnnxModel, instances: list[Message], run_size: int = 0) -> list[Outcome]:
    """The outcomes of a batch's requests, in no particular order. Requests in format v2 with the
    same layout have the same names, dtypes and shapes: the first is checked for all of them.
    Those that stack run `run_size` at a time (0: all in one run; batching.run_batch_size)."""
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
        outcomes.extend(_run_group(model, group, run_size))
    return outcomes


def predict_alike(model: OnnxModel, requests: AlikeRequests, run_size: int = 0) -> list[Outcome]:
    """The outcomes of an alike batch, run as it came: its inputs are stacked already, and its
    requests share a layout, so the first is checked for all (its values all, where the model
    casts them). Whatever fails goes the per-request way (predict), which says whose problem it is."""
    try:
        if requests.layout not in model.fitting_layouts:
            _check_alike(model, requests)
        return [Rows(requests.uris, model.run_columns(requests.tensors, run_size))]
    except Exception:
        return predict(model, requests.messages(), run_size)


def _check_alike(model: OnnxModel, requests: AlikeRequests) -> None:
    """Raises where an alike batch does not fit the model; remembers a layout that fits as it is."""
    first = {name: value[0] for name, value in requests.tensors.items()}
    model.prepare(first)
    if model.casts(first):
        model.check_values(requests.tensors)
    elif len(model.fitting_layouts) < MAX_FITTING_LAYOUTS:
        model.fitting_layouts.add(requests.layout)


def _out_of_range(model: OnnxModel, tensors: Feed) -> Exception | None:
    try:
        model.check_values(tensors)
    except InvalidInput as exc:
        return exc
    return None


def _run_group(model: OnnxModel, group: list[tuple[str, Feed]], run_size: int = 0) -> list[Outcome]:
    try:
        if not model.batched:
            return [Message(uri, tensors=model.run_one(feed), batch_size=1) for uri, feed in group]
        return [Rows([uri for uri, _ in group], model.run_stacked([feed for _, feed in group], run_size))]
    except Exception as exc:
        if len(group) > 1:
            # Find the instance that broke the run; its neighbours still get results.
            return [outcome for member in group for outcome in _run_group(model, [member])]
        log.warning("uri=%s inference failed: %s", group[0][0], exc)
        return [Message(uri=group[0][0], error=f"inference failed: {exc}", error_code="inference_failed")]
