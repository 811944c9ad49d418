"""Encoding: results -> one frame of (uri, result message bytes), split into Kafka records in the JVM."""

from __future__ import annotations

import logging
from pyflink.datastream import MapFunction

from conf import KAFKA_RECORD_BYTES
from connectors.codec import Message, encode_message
from job.frames import write_frame

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
    if len(payload) > MAX_RESULT_BYTES:
        return _refused(result.uri, f"result of {len(payload)} bytes is over the limit of {MAX_RESULT_BYTES}")
    return payload


def _refused(uri: str, reason: str) -> bytes:
    log.warning("uri=%s %s", uri, reason)
    return encode_message(Message(uri, error=reason))


class EncodeResults(MapFunction):
    def map(self, value: list[Message]) -> bytes:
        return write_frame((result.uri, encode_result(result)) for result in value)
