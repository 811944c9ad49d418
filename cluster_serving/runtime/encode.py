"""Encoding: results -> one frame of (uri, result message bytes), dead letters and alike sections
(the rows of a stacked run, made messages by the JVM), split into Kafka records in the JVM."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain

from cluster_serving.config import KAFKA_RECORD_BYTES
from cluster_serving.runtime.frames import AlikeResults, DeadLetter, UriBlock, write_frame
from cluster_serving.runtime.outcomes import Outcome, Rows
from cluster_serving.wire.codec import MAX_URI_CHARS, Message, carries, encode_message, encode_rows, stacked_rows
from cluster_serving.wire.open_inference import OipRequest, encode_answer

log = logging.getLogger(__name__)


# What a result's value may take: the record limit less room for its key (the uri) and framing.
MAX_RESULT_BYTES = KAFKA_RECORD_BYTES - 64 * 1024


def encode_result(result: Message) -> bytes:
    """The result's bytes; an output the wire format cannot carry, or one too large for a Kafka
    record (the sink would fail the job on it), becomes an error result."""
    try:
        payload = encode_message(result)
    except ValueError as exc:
        return _refused(result.uri, f"result not encodable: {exc}")
    return _within_limit(result.uri, payload)


def results_frame(outcomes: list[Outcome], dead_letters: list[DeadLetter] = (),
                  answers: dict[str, OipRequest] | None = None) -> bytes:
    """The frame of a batch's results and dead letters: each stacked run's rows as an alike
    section, when the format carries them, the rest as (uri, message) records; the requests in
    `answers` answered in their OIP encoding."""
    return batches_frame([(outcomes, dead_letters, answers or {})])


def batches_frame(batches: Iterable[tuple[list[Outcome], Sequence[DeadLetter], dict[str, OipRequest]]],
                  answered: Sequence[int] = ()) -> bytes:
    """One frame of several batches' (outcomes, dead letters, OIP answers) as results_frame
    writes one's, answering the request frames numbered `answered`."""
    sections, records, letters = [], [], []
    for outcomes, dead_letters, answers in batches:
        others = []
        for outcome in outcomes:
            section = alike_results(outcome) if isinstance(outcome, Rows) else None
            if section is None:
                others.append(outcome)
            else:
                sections.append(section)
        records.append(encode_outcomes(others, answers))
        letters.extend(dead_letters)
    return write_frame(chain.from_iterable(records), sections, letters, answered)


def alike_results(rows: Rows) -> AlikeResults | None:
    """A stacked run's results as one section, or None where encode_outcomes must look at each:
    an output format 2 cannot carry, or results that may be over the record limit."""
    if not rows.uris or not rows.outputs or not carries(rows.outputs):
        return None
    tail, row_size, values = stacked_rows(rows.outputs, rows.served)
    if 16 + 4 * MAX_URI_CHARS + len(tail) + row_size > MAX_RESULT_BYTES:
        return None
    return AlikeResults(UriBlock.of(rows.uris), tail, row_size, values)


def encode_outcomes(outcomes: list[Outcome], answers: dict[str, OipRequest]) -> Iterator[tuple[str, bytes]]:
    """(uri, result bytes) for every request of the batch; the rows of a stacked run are written
    together (encode_rows), each row checked as encode_result checks one."""
    for outcome in outcomes:
        if not isinstance(outcome, Rows):
            request = answers.get(outcome.uri)
            yield outcome.uri, encode_result(outcome) if request is None else encode_oip_answer(request, outcome)
            continue
        try:
            payloads = encode_rows(outcome.uris, outcome.outputs, outcome.served)
        except ValueError:  # an output the format cannot carry: each request says so
            payloads = [encode_result(message) for message in outcome.messages()]
        for uri, payload in zip(outcome.uris, payloads):
            yield uri, _within_limit(uri, payload)


def encode_oip_answer(request: OipRequest, result: Message) -> bytes:
    """An OIP request's answer, in its encoding; refused as encode_result refuses ours."""
    try:
        payload = encode_answer(request, result)
    except ValueError as exc:
        payload = encode_answer(request, Message(result.uri, error=f"result not encodable: {exc}", error_code="internal"))
    if len(payload) > MAX_RESULT_BYTES:
        reason = f"result of {len(payload)} bytes is over the limit of {MAX_RESULT_BYTES}"
        log.warning("uri=%s %s", result.uri, reason)
        payload = encode_answer(request, Message(result.uri, error=reason, error_code="internal"))
    return payload


def _within_limit(uri: str, payload: bytes) -> bytes:
    if len(payload) > MAX_RESULT_BYTES:
        return _refused(uri, f"result of {len(payload)} bytes is over the limit of {MAX_RESULT_BYTES}")
    return payload


def _refused(uri: str, reason: str) -> bytes:
    log.warning("uri=%s %s", uri, reason)
    return encode_message(Message(uri, error=reason, error_code="internal"))
