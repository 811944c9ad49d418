"""Streaming model serving on Kafka and PyFlink.

The public surface: `InputQueue` and `OutputQueue` (the client library), `SparseTensor` (a sparse
input), the errors the queues raise, and the `cluster-serving` command. The rooms below
(config, wire, kafka, runtime, job, client, http, ops) are the implementation; they import on
first use, so that `import cluster_serving.runtime` needs neither Kafka clients nor Flink.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cluster_serving.client import (
        DeliveryError, InputQueue, OutputQueue, PredictError, QueueFullError, ResultStore, SparseTensor,
    )

__all__ = ["DeliveryError", "InputQueue", "OutputQueue", "PredictError", "QueueFullError", "ResultStore", "SparseTensor"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("cluster_serving.client"), name)
    raise AttributeError(f"module 'cluster_serving' has no attribute {name!r}")
