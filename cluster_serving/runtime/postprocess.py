"""Postprocessing: model outputs -> the result users asked for (raw tensors, or BigDL's top-N)."""

from __future__ import annotations

import logging

import numpy as np

from cluster_serving.wire.codec import TOP_N_CLASSES, TOP_N_PROBABILITIES, Message

log = logging.getLogger(__name__)


def top_n(result: Message, n: int) -> Message:
    """The `n` largest values of the result's first output, best first, as two tensors (class
    indices and their values); error results pass through. A non-vector output is an error result:
    class indices of a flattened image would mean nothing."""
    if result.error is not None or not result.tensors:
        return result
    name, scores = next(iter(result.tensors.items()))
    scores = np.asarray(scores)
    if scores.ndim != 1 or scores.dtype.kind not in "iuf":
        error = f"postprocess failed: top_n needs a vector of scores, output {name!r} has shape {scores.shape}"
        log.warning("uri=%s %s", result.uri, error)
        return Message(result.uri, error=error, error_code="postprocess_failed")
    best = np.argsort(-scores.astype(np.float64), kind="stable")[:n]
    return Message(
        result.uri,
        tensors={TOP_N_CLASSES: best.astype(np.int64), TOP_N_PROBABILITIES: scores[best]},
        batch_size=result.batch_size,
        inference_us=result.inference_us,
        top_n=n,
    )
