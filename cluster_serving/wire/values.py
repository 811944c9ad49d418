"""What a message holds and the limits both format versions enforce: the vocabulary shared by the
kinds and both versions, so that each reads it from one place."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

import numpy as np

MAX_TENSORS = 64
MAX_RANK = 16
MAX_URI_CHARS = 1024
NUMERIC_DTYPES = frozenset(
    {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
     "float16", "float32", "float64"}
)
STRING_DTYPE = "str"
# An encoded image (JPEG/PNG bytes) as both versions name it.
IMAGE_DTYPE = "image"
# Kafka record headers of a request: the model (UTF-8 name) and version (decimal text) that are
# to serve it, absent for the default model and its newest version; and the header that marks a
# record as a routing table from the job's repository poller, not a request, with its signature
# (cluster_serving/job/control_key.py).
MODEL_HEADER = "model"
# Model names travel in Kafka headers and URL paths: no slashes, no spaces, no leading dot.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
VERSION_HEADER = "version"
# When the request stops being worth an answer: epoch milliseconds, as decimal text.
DEADLINE_HEADER = "deadline-ms"
CONTROL_HEADER = "cluster-serving-control"
SIGNATURE_HEADER = "cluster-serving-signature"
# The two tensors of a top-N result (metadata cs.top_n).
TOP_N_CLASSES = "classes"
TOP_N_PROBABILITIES = "probabilities"


class DecodeError(ValueError):
    """The bytes are not a valid message of a known format version."""


class TooLarge(DecodeError):
    """A message, or a tensor once decoded or made dense, over the size limit."""


# What an error result's `error_code` says, for programs (the bridge's HTTP status, clients,
# alerts); its text says the rest, for people.
ERROR_CODES = (
    "bad_request",  # the request cannot be read, or does not fit the model
    "too_large",  # the request is over limits.max_instance_bytes
    "unknown_model",  # no model of that name is served
    "unknown_version",  # the model serves no such version (or none opened)
    "preprocess_failed",  # the servable's preprocess function raised
    "inference_failed",  # the model's run raised
    "postprocess_failed",  # the servable's postprocess function or top-N failed
    "deadline_exceeded",  # the request's deadline had passed when its batch formed: not run
    "overloaded",  # its model's queue was full (servable.yaml max_queue_size): not run, send again later
    "internal",  # anything else on the serving side: a result that cannot be written, a broken pipeline
)


@dataclass(frozen=True)
class SparseTensor:
    """A COO sparse tensor: `indices` holds one row of len(shape) indices per value."""

    indices: np.ndarray  # (nnz, rank) int64
    values: np.ndarray  # (nnz,)
    shape: tuple[int, ...]

    def check(self, max_dense_bytes: int) -> None:
        """Raises ValueError unless the parts agree, every index is in bounds and the dense
        tensor stays within `max_dense_bytes` (it is densified before inference)."""
        nnz, rank = len(self.values), len(self.shape)
        if self.values.ndim != 1 or self.indices.shape != (nnz, rank):
            raise ValueError(
                f"{nnz} values need indices of shape ({nnz}, {rank}), got {self.indices.shape}"
            )
        if self.indices.dtype.kind not in "iu":
            raise ValueError(f"indices must be integers, got {self.indices.dtype}")
        if nnz and (self.indices.min() < 0 or np.any(self.indices.max(axis=0) >= np.array(self.shape))):
            raise ValueError(f"an index is outside the shape {list(self.shape)}")
        dense_bytes = math.prod(self.shape) * self.values.dtype.itemsize
        if dense_bytes > max_dense_bytes:
            raise TooLarge(f"{dense_bytes} bytes once dense, over the limit of {max_dense_bytes}")

    def to_dense(self) -> np.ndarray:
        dense = np.zeros(self.shape, dtype=self.values.dtype)
        if len(self.values):
            dense[tuple(self.indices.T)] = self.values
        return dense


@dataclass(frozen=True)
class EncodedImage:
    """A JPEG/PNG file's bytes, decoded by the job as its config says for that input."""

    data: bytes


Value = np.ndarray | SparseTensor | EncodedImage


@dataclass
class Message:
    """A decoded request or result."""

    uri: str
    tensors: dict[str, Value] = field(default_factory=dict)
    error: str | None = None
    error_code: str | None = None  # one of ERROR_CODES, with `error`
    batch_size: int | None = None
    inference_us: int | None = None
    top_n: int | None = None
    # Results: the model and its version that served the request (errors: as far as known).
    model: str | None = None
    model_version: int | None = None
    # Version 2 messages only: their layout's bytes. Messages with equal keys hold tensors of the
    # same names, dtypes and shapes, so the job checks one and stacks them all.
    layout_key: bytes | None = field(default=None, compare=False, repr=False)


def dtype_name(array: np.ndarray) -> str:
    """The wire name of an array's dtype; numpy's unicode and object-of-str arrays are 'str'."""
    if array.dtype.kind in "UO":
        return STRING_DTYPE
    return array.dtype.name


def check_uri(uri: str) -> None:
    if not uri or len(uri) > MAX_URI_CHARS:
        raise DecodeError("missing or over-long uri")


def parse_shape(name: str, text: str | None) -> tuple[int, ...]:
    """A shape from its JSON text; anything but a list of at most MAX_RANK ints in [0, 2^31) is
    refused, bools included (JSON's true is Python's 1)."""
    try:
        shape = json.loads(text or "")
    except ValueError:
        raise DecodeError(f"tensor {name!r}: shape is not a JSON list") from None
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_RANK
        or not all(isinstance(dim, int) and not isinstance(dim, bool) and 0 <= dim < 2**31 for dim in shape)
    ):
        raise DecodeError(f"tensor {name!r}: invalid shape {text!r}")
    return tuple(shape)
