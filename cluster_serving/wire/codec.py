"""Requests and results as bytes: the wire format's entry point. The format is described in
connectors/wire, whose modules hold its parts; here a message is written in the fastest version
that carries it, and either version is read, so that choice is made in one place for every room."""

from __future__ import annotations

import numpy as np

from cluster_serving.wire import v1, v2
from cluster_serving.wire.v2 import Served, carries, decode_stacked, encode_alike, encode_arrays, holds_images, message_from_parts, stacked_rows
from cluster_serving.wire.values import (
    CONTROL_HEADER,
    DEADLINE_HEADER,
    MAX_RANK,
    MAX_TENSORS,
    MAX_URI_CHARS,
    MODEL_HEADER,
    MODEL_NAME,
    SIGNATURE_HEADER,
    TOP_N_CLASSES,
    TOP_N_PROBABILITIES,
    VERSION_HEADER,
    ERROR_CODES,
    DecodeError,
    EncodedImage,
    Message,
    SparseTensor,
    TooLarge,
    Value,
    dtype_name,
)

__all__ = [
    "CONTROL_HEADER", "DEADLINE_HEADER", "MODEL_HEADER", "MODEL_NAME", "VERSION_HEADER", "MAX_RANK", "MAX_TENSORS", "MAX_URI_CHARS", "SIGNATURE_HEADER", "TOP_N_CLASSES", "TOP_N_PROBABILITIES", "DecodeError",
    "ERROR_CODES", "TooLarge", "EncodedImage", "Message", "Served", "SparseTensor", "Value", "decode_message", "dtype_name", "encode_message",
    "encode_alike", "encode_arrays", "encode_rows", "carries", "decode_stacked", "holds_images", "message_from_parts", "stacked_rows",
]


def encode_message(message: Message, version: int | None = None) -> bytes:
    """Serialises a message in `version`, by default version 2 when it can carry the message;
    refuses dtypes outside the allow-list and inconsistent sparse tensors."""
    if len(message.uri) > MAX_URI_CHARS:
        raise ValueError(f"uri longer than {MAX_URI_CHARS} characters")
    if version != 1 and v2.fits(message):
        return v2.encode(message)
    return v1.encode(message)


def decode_message(payload: bytes, max_bytes: int) -> Message:
    """Parses and validates a message; every problem raises DecodeError with a readable reason."""
    if len(payload) > max_bytes:
        raise TooLarge(f"message of {len(payload)} bytes exceeds the limit of {max_bytes}")
    if payload[:4] == v2.V2_MAGIC:
        return v2.decode(payload)
    return v1.decode(payload, max_bytes)


def encode_rows(uris: list[str], tensors: dict[str, np.ndarray], served: Served = Served()) -> list[bytes]:
    """One message per uri, holding row i of every stacked tensor (first dimension len(uris)): the
    results of one batched run. Version 2 shares one layout and one copy of each tensor among the
    rows; other dtypes (strings) go through encode_message row by row."""
    if v2.carries(tensors):
        return v2.encode_rows(uris, tensors, served)
    return [
        encode_message(Message(uri, {name: value[i] for name, value in tensors.items()}, batch_size=served.batch_size,
                               inference_us=served.inference_us, model=served.model, model_version=served.model_version))
        for i, uri in enumerate(uris)
    ]
