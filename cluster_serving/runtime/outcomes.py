"""What serving a request ends in: a result (one `Message`, or a row of a stacked run's `Rows`) or
an error result, and the input errors that lead to one."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from cluster_serving.wire.codec import DecodeError, Message, Served, TooLarge

log = logging.getLogger(__name__)


class InvalidInput(ValueError):
    """An instance does not fit the model: missing, unknown, mistyped or misshapen inputs."""


class DeadlineExceeded(Exception):
    """The request's deadline had passed when its batch formed."""


@dataclass
class Rows:
    """The results of one stacked group (in one run, or runs of batching.run_batch_size): row i of
    every output belongs to uris[i]. Kept stacked so that the encoder writes them without
    splitting them into per-request dicts."""

    uris: list[str]
    outputs: dict[str, np.ndarray]
    inference_us: int | None = None
    model: str | None = None
    model_version: int | None = None
    # The batches its rows were served in, each of this many, where the rows are several batches'
    # (a frame of joined batches, job/batch.py); None: one batch of them all.
    batch_size: int | None = None

    @property
    def served(self) -> Served:
        """What each row's result says of how it was served."""
        return Served(self.batch_size or len(self.uris), self.inference_us, self.model, self.model_version)

    def messages(self) -> list[Message]:
        batch_size, inference_us, model, model_version = self.served
        return [
            Message(uri, {name: value[i] for name, value in self.outputs.items()}, batch_size=batch_size,
                    inference_us=inference_us, model=model, model_version=model_version)
            for i, uri in enumerate(self.uris)
        ]


Outcome = Message | Rows


def by_batch(outcome: Outcome, batch_size: int) -> list[Outcome]:
    """The outcome of a frame of joined batches (job/batch.py), its rows naming the batch each ran
    in: `batch_size` for the full batches, its own size for a partial last one."""
    if not isinstance(outcome, Rows) or len(outcome.uris) <= batch_size:
        return [outcome]
    whole = len(outcome.uris) // batch_size * batch_size
    if whole == len(outcome.uris):
        outcome.batch_size = batch_size
        return [outcome]
    head, tail = (Rows(outcome.uris[part], {name: value[part] for name, value in outcome.outputs.items()},
                       outcome.inference_us, outcome.model, outcome.model_version)
                  for part in (slice(0, whole), slice(whole, None)))
    head.batch_size = batch_size
    return [head, tail]


def as_messages(outcomes: list[Outcome]) -> list[Message]:
    """One message per request: what postprocessing and tests read."""
    return [message for outcome in outcomes for message in (outcome.messages() if isinstance(outcome, Rows) else [outcome])]


def error_result(uri: str, kind: str, exc: Exception, code: str = "bad_request") -> Message:
    """The error result for one request, with its code (wire.ERROR_CODES; too_large for a
    TooLarge whatever the caller says), logged; an exception that no check raised on purpose is a
    bug to fix, so its traceback goes to the log too."""
    expected = isinstance(exc, (DecodeError, InvalidInput, DeadlineExceeded))
    log.warning("uri=%s %s: %s", uri, kind, reason(exc), exc_info=not expected)
    return Message(uri=uri, error=f"{kind}: {reason(exc)}", error_code="too_large" if isinstance(exc, TooLarge) else code)


def reason(exc: Exception) -> str:
    """An exception as the client reads it: our own checks' messages as they are, any other with
    its type, which is often all it says (a bare KeyError or MemoryError)."""
    if isinstance(exc, (DecodeError, InvalidInput, DeadlineExceeded)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
