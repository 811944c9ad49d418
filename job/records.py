"""The values that flow between the job's stages (inside one fused Python operator)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Instance:
    """One decoded request: its uri and named input tensors."""

    uri: str
    tensors: dict[str, np.ndarray]


@dataclass
class Outcome:
    """What a request's result message will say: outputs, or the error that stopped it."""

    uri: str
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    error: str | None = None
    batch_size: int | None = None


@dataclass
class DecodedBatch:
    """A micro-batch after decoding: instances to run, and requests already answered by an error."""

    instances: list[Instance]
    rejected: list[Outcome]
