"""Encoding: outcomes -> Row(uri, result message) for the Kafka sink."""

from __future__ import annotations

import logging
from typing import Iterable

from pyflink.common import Row
from pyflink.datastream import FlatMapFunction

from connectors.codec import Message, encode_message
from job.records import Outcome

log = logging.getLogger(__name__)


def encode_outcome(outcome: Outcome) -> bytes:
    """The result message; an output the wire format cannot carry becomes an error result."""
    message = Message(outcome.uri, outcome.outputs, outcome.error, outcome.batch_size)
    try:
        return encode_message(message)
    except ValueError as exc:
        log.warning("uri=%s result not encodable: %s", outcome.uri, exc)
        return encode_message(Message(outcome.uri, error=f"result not encodable: {exc}"))


class EncodeOutcomes(FlatMapFunction):
    def flat_map(self, value: list[Outcome]) -> Iterable[Row]:
        for outcome in value:
            yield Row(outcome.uri, encode_outcome(outcome))
