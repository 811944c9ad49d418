"""One reader of the result topic for the whole HTTP bridge, completing one future per waiting uri.

A request registers its uris before it produces them, then awaits their futures: thousands of
waiting requests cost one consumer thread, not one poll loop each. The consumer starts at the
topic's end (the bridge's uris are new, so nothing earlier can be theirs) and only decodes records
whose key is a uri somebody waits for.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from typing import Any, Callable

from kafka import KafkaConsumer, TopicPartition

from conf import KAFKA_RECORD_BYTES
from connectors.codec import DecodeError, Message, decode_message

log = logging.getLogger(__name__)
REMEMBER_TIMED_OUT = 100_000


class ResultWaiter:
    def __init__(
        self, bootstrap_servers: str, topic: str, uri_prefix: str, on_late: Callable[[], None], **kafka: Any
    ):
        self.topic = topic
        self.on_late = on_late
        self.uri_prefix = uri_prefix
        self._consumer = KafkaConsumer(
            bootstrap_servers=bootstrap_servers, enable_auto_commit=False, **kafka
        )
        self._pending: dict[str, asyncio.Future[Message]] = {}
        self._timed_out: OrderedDict[str, None] = OrderedDict()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._consume, name="result-waiter", daemon=True)
        self.duplicates = 0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Positions the consumer at the end of every partition, then starts reading."""
        partitions = self._consumer.partitions_for_topic(self.topic)
        if not partitions:
            raise RuntimeError(f"result topic {self.topic!r} has no partitions (does it exist?)")
        assigned = [TopicPartition(self.topic, pid) for pid in sorted(partitions)]
        self._consumer.assign(assigned)
        self._consumer.seek_to_end(*assigned)
        for partition in assigned:
            self._consumer.position(partition)  # resolves the end offset now, not at first poll
        self._loop = loop
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def waiting(self) -> int:
        return len(self._pending)

    def expect(self, uri: str) -> asyncio.Future[Message]:
        """A future for `uri`'s result; call on the event loop, before producing the request."""
        future = asyncio.get_running_loop().create_future()
        self._pending[uri] = future
        return future

    def forget(self, uri: str) -> None:
        """Releases a uri whose request gave up (timeout, client gone); a later result is counted late."""
        future = self._pending.pop(uri, None)
        if future is not None:  # still registered: no result came (a timeout may have cancelled it)
            future.cancel()
            self._timed_out[uri] = None
            while len(self._timed_out) > REMEMBER_TIMED_OUT:
                self._timed_out.popitem(last=False)

    def fail(self, uri: str, exc: BaseException) -> None:
        """The request for `uri` could not be produced: its waiter gets the error at once."""
        future = self._pending.pop(uri, None)
        if future is not None and not future.done():
            future.set_exception(exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._consumer.close()

    def _consume(self) -> None:
        while not self._stop.is_set():
            try:
                batches = self._consumer.poll(timeout_ms=200)
            except Exception:  # the broker went away: keep trying, readiness reports it
                log.exception("reading %s failed; retrying", self.topic)
                self._stop.wait(1.0)
                continue
            results = [self._decode(record.key, record.value) for records in batches.values() for record in records]
            ours = [result for result in results if result is not None]
            if ours:  # one wake-up of the event loop per poll, not one per result
                assert self._loop is not None
                self._loop.call_soon_threadsafe(self._complete, ours)

    def _decode(self, key: bytes | None, value: bytes | None) -> tuple[str, Message] | None:
        """(uri, result) for a result of this bridge's; None for others' results."""
        uri = key.decode(errors="replace") if key else ""
        if not uri.startswith(self.uri_prefix):
            return None
        try:
            return uri, decode_message(value or b"", KAFKA_RECORD_BYTES)
        except DecodeError as exc:
            return uri, Message(uri, error=f"unreadable result: {exc}")

    def _complete(self, results: list[tuple[str, Message]]) -> None:
        for uri, message in results:
            future = self._pending.pop(uri, None)
            if future is not None and not future.done():
                future.set_result(message)
            elif uri in self._timed_out:
                self.on_late()
                log.info("uri=%s result arrived after its request timed out; dropped", uri)
            else:
                self.duplicates += 1

