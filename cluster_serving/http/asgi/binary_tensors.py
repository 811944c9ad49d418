"""The open inference protocol's binary tensor data extension (Triton's and KServe's): tensor values
as raw bytes after the JSON part of the body instead of JSON numbers.

A 3x64x64 float32 image is 48 KiB raw and about 250 KB as JSON text, whose parsing cost the bridge
more than the model's inference. The request's `Inference-Header-Content-Length` header says
where the JSON ends; an input with `parameters.binary_data_size` takes its values from the bytes
that follow, in input order. Outputs are sent the same way when the request asks with
`parameters.binary_data_output` (all) or an output's `parameters.binary_data`.

Values are little-endian, row-major; BOOL is one byte per value (0 or 1); BYTES is, per value, a
4-byte little-endian length and that many bytes (UTF-8 text here: string tensors hold str).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.types import Send

from cluster_serving.http.errors import InvalidRequest
from cluster_serving.http.json_tensors import json_bytes, v2_numpy_dtype
from cluster_serving.wire.tensors import TensorError, raw_values

HEADER_LENGTH = "inference-header-content-length"


def split_body(body: bytes, header_length: str) -> tuple[bytes, bytes]:
    """(the JSON part, the binary part) as the header divides them."""
    if not header_length.isascii() or not header_length.isdigit() or int(header_length) > len(body):
        raise InvalidRequest(
            f"Inference-Header-Content-Length must be a byte count within the body's {len(body)} bytes, got {header_length!r}"
        )
    return body[: int(header_length)], body[int(header_length):]


def with_binary_values(inputs: list[dict[str, Any]], binary: bytes) -> list[dict[str, Any]]:
    """The inputs with each binary input's `data` read from its share of `binary`, in order; every
    byte must belong to exactly one input."""
    taken = 0
    read = []
    for tensor in inputs:
        size = (tensor.get("parameters") or {}).get("binary_data_size")
        if size is None:
            if tensor.get("data") is None:
                raise InvalidRequest(f"input {tensor['name']!r}: needs 'data' or parameters.binary_data_size")
            read.append(tensor)
            continue
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or taken + size > len(binary):
            raise InvalidRequest(
                f"input {tensor['name']!r}: binary_data_size {size!r} is not within the {len(binary) - taken} bytes left"
            )
        if tensor.get("data") is not None:
            raise InvalidRequest(f"input {tensor['name']!r}: has both 'data' and binary_data_size")
        chunk = binary[taken: taken + size]
        taken += size
        read.append({**tensor, "data": values_from_bytes(tensor["name"], tensor["datatype"], chunk)})
    if taken != len(binary):
        raise InvalidRequest(f"{len(binary) - taken} bytes of binary data belong to no input")
    return read


def values_from_bytes(name: str, datatype: str, chunk: bytes) -> np.ndarray:
    """One input's values, flat; the caller checks them against the shape."""
    try:
        return raw_values(name, v2_numpy_dtype(name, datatype), chunk)
    except TensorError as exc:
        raise InvalidRequest(str(exc)) from None


@dataclass(frozen=True)
class BinaryAnswer:
    """A response whose JSON part is followed by binary output values."""

    header: dict[str, Any]
    chunks: list[bytes]


async def send_binary(send: Send, answer: BinaryAnswer) -> None:
    """A 200 of the JSON part then the outputs' bytes, the JSON part's length in the header."""
    header = json_bytes(answer.header)
    length = len(header) + sum(len(chunk) for chunk in answer.chunks)
    headers = [
        (b"content-type", b"application/octet-stream"),
        (b"content-length", b"%d" % length),
        (HEADER_LENGTH.encode(), b"%d" % len(header)),
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"".join([header, *answer.chunks])})
