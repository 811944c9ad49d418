"""Encoding: results -> Row(uri, result message bytes) for the Kafka sink."""

from __future__ import annotations

import logging
from typing import Iterable

from pyflink.common import Row
from pyflink.datastream import FlatMapFunction

from connectors.codec import Message, encode_message

log = logging.getLogger(__name__)


def encode_result(result: Message) -> bytes:
    """The result's bytes; an output the wire format cannot carry becomes an error result."""
    try:
        return encode_message(result)
    except ValueError as exc:
        log.warning("uri=%s result not encodable: %s", result.uri, exc)
        return encode_message(Message(result.uri, error=f"result not encodable: {exc}"))


class EncodeResults(FlatMapFunction):
    def flat_map(self, value: list[Message]) -> Iterable[Row]:
        for result in value:
            yield Row(result.uri, encode_result(result))
