"""What users import: InputQueue puts requests on the input topic, OutputQueue reads results.

    from client import InputQueue, OutputQueue
    InputQueue(bootstrap_servers="127.0.0.1:9092").enqueue("img-1", features=array)
    OutputQueue(bootstrap_servers="127.0.0.1:9092").query("img-1", timeout=5)
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

import numpy as np
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from connectors.codec import DecodeError, Message, decode_message, encode_message

log = logging.getLogger(__name__)

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
DEFAULT_INPUT_TOPIC = "serving_stream"
DEFAULT_RESULT_TOPIC = "serving_result"
DEFAULT_CLIENT_GROUP = "cluster-serving-client"
MAX_RESULT_BYTES = 256 * 1024 * 1024
Result = dict[str, Any]


class InputQueue:
    """Sends requests: `enqueue(uri, **tensors)`, one Kafka record per request, key = uri."""

    def __init__(self, bootstrap_servers: str = DEFAULT_BOOTSTRAP, topic: str = DEFAULT_INPUT_TOPIC, **kafka: Any):
        self.topic = topic
        self._producer = KafkaProducer(
            bootstrap_servers=bootstrap_servers, linger_ms=5, acks="all", **kafka
        )

    def enqueue(self, uri: str, **tensors: Any) -> None:
        """Queues one request; returns once it is handed to the producer (call flush() to wait)."""
        if not isinstance(uri, str) or not uri:
            raise ValueError("uri must be a non-empty string")
        if not tensors:
            raise ValueError("enqueue needs at least one named tensor, e.g. enqueue(uri, x=array)")
        payload = encode_message(Message(uri, {name: np.asarray(value) for name, value in tensors.items()}))
        self._producer.send(self.topic, key=uri.encode(), value=payload)

    def flush(self, timeout: float | None = None) -> None:
        self._producer.flush(timeout=timeout)

    def close(self) -> None:
        self._producer.close()

    def __enter__(self) -> InputQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ResultStore:
    """Results by uri. At-least-once delivery can repeat a result: it is kept once and counted,
    also after it was handed out (the last `remember` delivered uris are remembered)."""

    def __init__(self, remember: int = 1_000_000):
        self._results: dict[str, Result] = {}
        self._delivered: OrderedDict[str, None] = OrderedDict()
        self._remember = remember
        self.duplicates = 0

    def add(self, uri: str, result: Result) -> None:
        if uri in self._results or uri in self._delivered:
            self.duplicates += 1
            return
        self._results[uri] = result

    def get(self, uri: str) -> Result | None:
        return self._results.get(uri)

    def take_all(self) -> dict[str, Result]:
        taken, self._results = self._results, {}
        for uri in taken:
            self._delivered[uri] = None
        while len(self._delivered) > self._remember:
            self._delivered.popitem(last=False)
        return taken

    def __len__(self) -> int:
        return len(self._results)


def result_of(message: Message) -> Result:
    """A result as users see it: output name -> ndarray, or {'error': message}."""
    if message.error is not None:
        return {"error": message.error}
    return dict(message.tensors)


class OutputQueue:
    """Reads results: `query(uri, timeout)` waits for one, `dequeue()` takes all that are there.

    It reads every partition of the result topic itself (no consumer-group rebalancing) and keeps
    its position as the committed offset of `group_id`, moved forward by `dequeue()`.
    """

    def __init__(
        self,
        bootstrap_servers: str = DEFAULT_BOOTSTRAP,
        topic: str = DEFAULT_RESULT_TOPIC,
        group_id: str = DEFAULT_CLIENT_GROUP,
        **kafka: Any,
    ):
        self.topic = topic
        self.store = ResultStore()
        self._consumer = KafkaConsumer(
            bootstrap_servers=bootstrap_servers,
            group_id=group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=50,
            **kafka,
        )
        self._partitions: list[TopicPartition] = []

    def query(self, uri: str, timeout: float = 0.0) -> Result | None:
        """The result for `uri`, waiting up to `timeout` seconds; None when it is not there."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.store.get(uri)
            if result is not None:
                return result
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self._poll(min(remaining, 0.5))

    def dequeue(self) -> dict[str, Result]:
        """All results that reached the topic before this call, removed from the queue (offsets
        committed). Results arriving meanwhile wait for the next call, so it always returns."""
        if self._assign():
            targets = self._consumer.end_offsets(self._partitions)
            while any(self._consumer.position(tp) < targets[tp] for tp in self._partitions):
                self._poll(0.05)
        results = self.store.take_all()
        if self._partitions:
            self._consumer.commit()
        return results

    def _assign(self) -> bool:
        if not self._partitions:
            ids = self._consumer.partitions_for_topic(self.topic)
            if ids:
                self._partitions = [TopicPartition(self.topic, pid) for pid in sorted(ids)]
                self._consumer.assign(self._partitions)
        return bool(self._partitions)

    def _poll(self, timeout_s: float) -> int:
        if not self._assign():
            time.sleep(timeout_s)
            return 0
        count = 0
        for records in self._consumer.poll(timeout_ms=int(timeout_s * 1000)).values():
            for record in records:
                count += 1
                try:
                    message = decode_message(record.value or b"", MAX_RESULT_BYTES)
                except DecodeError as exc:
                    log.warning("unreadable result at offset %d skipped: %s", record.offset, exc)
                    continue
                self.store.add(message.uri, result_of(message))
        return count

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> OutputQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
