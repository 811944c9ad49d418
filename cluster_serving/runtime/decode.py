"""Decoding: a batch's records -> its requests, and error results for what cannot be read (bad
bytes, a record key that is not the payload's uri) or is no longer worth an answer (a deadline
passed). Images and sparse tensors are made arrays once the batch's servable is known, as its
settings say (`prepare_instances`, called by serve.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np

from cluster_serving.config import ImageConfig, LimitsConfig
from cluster_serving.runtime.frames import DRAIN, POLL, AlikeRecords, Frame, Headers, Source, UriBlock, read_frame, read_headers
from cluster_serving.runtime.outcomes import DeadlineExceeded, InvalidInput, error_result, reason
from cluster_serving.runtime.preprocess import DEFAULT_IMAGE, BatchArray, decode_images, prepare_values
from cluster_serving.wire.codec import (
    DEADLINE_HEADER,
    MAX_URI_CHARS,
    DecodeError,
    EncodedImage,
    Message,
    Served,
    decode_message,
    decode_stacked,
    holds_images,
)
from cluster_serving.wire.open_inference import (
    RECORD_TIMESTAMP_HEADER,
    OipRequest,
    answer_to,
    decode_request,
    protocol_of,
    sniffed_encoding,
)


@dataclass
class AlikeRequests:
    """The requests of an alike batch (frames.py), decoded together: each input stacked, row i
    request i's. `served`: what their layout says of how they were served (results only)."""

    uris: UriBlock
    tensors: dict[str, np.ndarray]
    layout: bytes
    served: Served

    def __len__(self) -> int:
        return len(self.uris)

    def messages(self) -> list[Message]:
        """One message per request, as decoding each alone would have made it."""
        batch_size, inference_us, model, model_version = self.served
        return [Message(uri, {name: value[i] for name, value in self.tensors.items()}, None, None,
                        batch_size, inference_us, None, model, model_version, self.layout)
                for i, uri in enumerate(self.uris)]

log = logging.getLogger(__name__)


@dataclass
class DecodedBatch:
    """A micro-batch after decoding: requests to run, and error results for those that cannot be;
    or, for a control frame, the routing table's text alone; or, for a poll or drain frame
    (frames.POLL, frames.DRAIN), that kind as `signal` alone."""

    instances: list[Message]
    rejected: list[Message]
    # The route as the requests' headers named it ("": the default model, the newest version).
    model: str = ""
    version: str = ""
    table: str | None = None
    signal: str | None = None
    # The request frame's number, in the order the JVM sent them (frames.py); -1: not counted.
    ordinal: int = -1
    # Records without a uri to answer (logged, no result possible): (index in the frame, why).
    dropped: list[tuple[int, str]] = field(default_factory=list)
    # An alike batch's requests, decoded together (then `instances` is empty).
    alike: AlikeRequests | None = None
    # Requests answered deadline_exceeded (among `rejected`).
    expired: int = 0
    # The frame the batch came in: its requests as they came, for their dead letters.
    frame: Frame | None = field(default=None, repr=False)
    # The requests in an Open Inference Protocol encoding, by uri: how each is to be answered.
    answers: dict[str, OipRequest] = field(default_factory=dict)
    # Records without a key whose value named their uri: uri -> index in the frame (for a dead letter).
    unkeyed: dict[str, int] = field(default_factory=dict)

    @property
    def size(self) -> int:
        """The records the batch came as."""
        return len(self.instances) + len(self.rejected) + len(self.dropped) + (len(self.alike) if self.alike else 0)

    def requests(self) -> list[Message]:
        """Every request to serve, one message each (an alike batch's made so now)."""
        if self.alike is not None:
            self.instances, self.alike = self.alike.messages(), None
        return self.instances


def decode_frame(frame: bytes, limits: LimitsConfig) -> DecodedBatch:
    """A frame from the JVM (frames.py) -> its decoded batch, or the routing table it carries."""
    read = read_frame(frame)
    if read.table is not None:
        return DecodedBatch([], [], table=read.table)
    if read.kind in (POLL, DRAIN):
        return DecodedBatch([], [], signal=read.kind)
    if read.alike is not None and not holds_images(read.alike.layout):
        batch = decode_alike(read.alike)
    else:  # images of one size came alike: each is read alone, as other images are
        records, sources = (read.records, read.sources) if read.alike is None else (read.alike.records(), read.alike.sources)
        batch, batch.dropped = decode_records(records, limits, sources)
        batch.expired = sum(1 for message in batch.rejected if message.error_code == "deadline_exceeded")
    batch.model, batch.version, batch.frame = read.model, read.version, read
    return batch


def decode_records(
    records: list[tuple[str | None, bytes]], limits: LimitsConfig, sources: Sequence[Source] = ()
) -> tuple[DecodedBatch, list[tuple[int, str]]]:
    """Returns the decoded batch and the records dropped for lack of a uri to answer (index, why).
    A record whose `sources` entry has a deadline that has passed is answered deadline_exceeded
    without being decoded.

    Whatever one record holds, it ends up an instance, an error result or a dropped one: any
    exception from reading it, expected or not, stays that record's problem, since one escaping
    would restart the job and fail every other request in flight."""
    instances: list[Message] = []
    rejected: list[Message] = []
    dropped: list[tuple[int, str]] = []
    expired: list[str] = []
    answers: dict[str, OipRequest] = {}
    unkeyed: dict[str, int] = {}
    now_ms = time.time() * 1000
    for index, (key, payload) in enumerate(records):
        try:
            block = sources[index].headers if index < len(sources) else None
            message = _decode_record(key, payload or b"", read_headers(block) if block else [], limits, now_ms, answers)
        except Exception as exc:
            if not key or len(key) > MAX_URI_CHARS:
                log.warning("uri=%s dropped, no result can answer it: %s", _unusable_key(key), reason(exc))
                dropped.append((index, reason(exc)))
            elif isinstance(exc, DeadlineExceeded):  # logged together below: a backlog of them is common
                rejected.append(Message(key, error=f"deadline exceeded: {exc}", error_code="deadline_exceeded"))
                expired.append(key)
            else:
                rejected.append(error_result(key, "bad request", exc))
            continue
        if key is None:
            unkeyed[message.uri] = index
        instances.append(message)
    if expired:
        log.warning("deadline exceeded, not run: %s", " ".join(f"uri={uri}" for uri in expired))
    return DecodedBatch(instances, rejected, answers=answers, unkeyed=unkeyed), dropped


def _decode_record(key: str | None, payload: bytes, headers: Headers, limits: LimitsConfig, now_ms: float,
                   answers: dict[str, OipRequest]) -> Message:
    """One record's request, in our format or an OIP encoding (noted in `answers`, an error too
    is answered in the encoding the record claims)."""
    _check_deadline(headers, now_ms)
    encoding = protocol_of(headers, payload)
    if encoding is not None:
        if key:
            answers[key] = answer_to(encoding, key)
        return _decode_oip(key, payload, encoding, limits, answers, headers, now_ms)
    try:
        message = decode_message(payload, limits.max_instance_bytes)
    except DecodeError:
        sniffed = sniffed_encoding(payload)
        if sniffed is None:
            raise
        try:
            return _decode_oip(key, payload, sniffed, limits, answers)
        except Exception:  # not OIP either: our format's reason is the one to give
            pass
        raise
    if key is not None and key != message.uri:
        raise DecodeError(f"the record key is not the payload's uri {message.uri[:100]!r}")
    return message


def _decode_oip(key: str | None, payload: bytes, encoding: str, limits: LimitsConfig,
                answers: dict[str, OipRequest], headers: Headers = (), now_ms: float = 0.0) -> Message:
    message, request = decode_request(payload, encoding, key, limits.max_instance_bytes)
    answers[message.uri] = request
    if request.timeout_us is not None:
        _check_timeout(headers, request.timeout_us, now_ms)
    return message


def _check_timeout(headers: Headers, timeout_us: int, now_ms: float) -> None:
    """Raises DeadlineExceeded when an OIP request's timeout, from its record's timestamp, has passed."""
    sent = next((value for name, value in headers if name == RECORD_TIMESTAMP_HEADER), None)
    if sent is None or not sent.isdigit():
        return  # a record without an OIP header: no timestamp to count from
    late = now_ms - (int(sent) + timeout_us / 1000)
    if late > 0:
        raise DeadlineExceeded(f"its timeout of {timeout_us} us from the record's timestamp passed {late:.0f} ms before its batch formed")


def _check_deadline(headers: Headers, now_ms: float) -> None:
    """Raises DeadlineExceeded when the deadline header says a time before `now_ms`, DecodeError
    when it says no time."""
    for name, value in headers:
        if name != DEADLINE_HEADER:
            continue
        text = (value or b"").decode(errors="replace")
        if not text.isascii() or not text.isdigit() or len(text) > 15:
            raise DecodeError(f"header {DEADLINE_HEADER} must be epoch milliseconds, got {text[:40]!r}")
        if int(text) < now_ms:
            raise DeadlineExceeded(f"the deadline passed {now_ms - int(text):.0f} ms before its batch formed")


def decode_alike(records: AlikeRecords) -> DecodedBatch:
    """An alike batch, decoded together; a layout that does not decode fails each request, as it
    would have alone."""
    try:
        tensors, served = decode_stacked(records.layout, len(records.uris), records.values)
    except DecodeError as exc:
        return DecodedBatch([], [error_result(uri, "bad request", exc) for uri in records.uris])
    return DecodedBatch([], [], alike=AlikeRequests(records.uris, tensors, records.layout, served))


def prepare_instances(
    instances: list[Message], images: dict[str, ImageConfig], limits: LimitsConfig, pool: Executor | None = None,
    batch_array: Callable[[str], BatchArray] | None = None,
) -> tuple[list[Message], list[Message]]:
    """(instances whose values are all arrays now, error results): images decoded, an input's
    images of the whole batch together in `pool` into `batch_array(input)`'s array
    (decode_images), and sparse tensors made dense.
    Format v2 holds dense tensors only: nothing to do. As in decode_records, any exception is
    that request's error result."""
    refused = _decode_images(instances, images, limits, pool, batch_array)
    ready, rejected = [], []
    for index, message in enumerate(instances):
        try:
            if index in refused:
                raise refused[index]
            if message.layout_key is None:
                message.tensors = prepare_values(message.tensors, images, limits)
        except Exception as exc:
            rejected.append(error_result(message.uri, "invalid input", exc))
            continue
        ready.append(message)
    return ready, rejected


def _decode_images(
    instances: list[Message], images: dict[str, ImageConfig], limits: LimitsConfig, pool: Executor | None,
    batch_array: Callable[[str], BatchArray] | None,
) -> dict[int, InvalidInput]:
    """Puts each instance's decoded images in its tensors; returns why, by instance, an image did not decode."""
    inputs: dict[str, list[int]] = {}
    for index, message in enumerate(instances):
        for name, value in message.tensors.items():
            if isinstance(value, EncodedImage):
                inputs.setdefault(name, []).append(index)
    refused: dict[int, InvalidInput] = {}
    for name, indices in inputs.items():
        datas = [instances[index].tensors[name].data for index in indices]
        config = images.get(name, DEFAULT_IMAGE)
        arrays = decode_images(name, datas, config, limits.max_image_pixels, pool, batch_array(name) if batch_array else np.empty)
        for index, array in zip(indices, arrays):
            if isinstance(array, InvalidInput):
                refused.setdefault(index, array)
            else:
                instances[index].tensors[name] = array
    return refused


def _unusable_key(key: str | None) -> str:
    """A record key that cannot be a result's uri (none, or over MAX_URI_CHARS), as a log line
    shows it: like a uri, so that one grep for `uri=` finds every request's error, but short."""
    return repr(key) if not key else f"{key[:64]!r}... ({len(key)} characters)"
