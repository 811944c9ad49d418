"""Decoding: raw records of a micro-batch -> requests, or error results for what cannot be read."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pyflink.common import Row
from pyflink.datastream import MapFunction, RuntimeContext

from connectors.codec import MAX_URI_CHARS, DecodeError, Message, decode_message

log = logging.getLogger(__name__)


@dataclass
class DecodedBatch:
    """A micro-batch after decoding: requests to run, and error results for those that cannot be."""

    instances: list[Message]
    rejected: list[Message]


def decode_records(records: list[Row], max_bytes: int) -> tuple[DecodedBatch, int]:
    """Returns the decoded batch and how many records were dropped for lack of a uri to answer."""
    instances: list[Message] = []
    rejected: list[Message] = []
    dropped = 0
    for key, payload in records:
        try:
            message = decode_message(payload or b"", max_bytes)
        except DecodeError as exc:
            if key and len(key) <= MAX_URI_CHARS:
                log.warning("uri=%s rejected: %s", key, exc)
                rejected.append(Message(uri=key, error=f"bad request: {exc}"))
            else:
                log.warning("record without a usable key dropped: %s", exc)
                dropped += 1
            continue
        instances.append(message)
    return DecodedBatch(instances, rejected), dropped


class DecodeBatch(MapFunction):
    """The Flink stage around `decode_records`, counting decode errors for the Flink UI."""

    def __init__(self, max_instance_bytes: int):
        self.max_instance_bytes = max_instance_bytes

    def open(self, runtime_context: RuntimeContext) -> None:
        group = runtime_context.get_metrics_group().add_group("cluster_serving")
        self.records_in = group.counter("requests")
        self.decode_errors = group.counter("decodeErrors")

    def map(self, value: list[Row]) -> DecodedBatch:
        batch, dropped = decode_records(value, self.max_instance_bytes)
        self.records_in.inc(len(value))
        self.decode_errors.inc(len(batch.rejected) + dropped)
        return batch
