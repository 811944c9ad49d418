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

from confluent_kafka import Consumer
from confluent_kafka import Message as Record

from cluster_serving.config import KAFKA_RECORD_BYTES
from cluster_serving.kafka.clients import client_or_config_error
from cluster_serving.kafka.librdkafka import end_offsets, fetched
from cluster_serving.wire.codec import DecodeError, Message, decode_message

log = logging.getLogger(__name__)
REMEMBER_TIMED_OUT = 100_000
# The longest a read waits for the first result: how soon stop() is noticed.
CONSUME_WAIT_S = 0.2


class ResultWaiter:
    def __init__(self, settings: dict[str, Any], topic: str, uri_prefix: str, on_late: Callable[[], None]):
        """`settings`: the librdkafka consumer's (bridge.kafka_clients.librdkafka_settings). It
        joins no group and commits nothing; librdkafka asks for a group id all the same."""
        self.topic = topic
        self.on_late = on_late
        self.uri_prefix = uri_prefix
        self._consumer: Consumer = client_or_config_error(lambda: Consumer(
            {**settings, "group.id": f"{uri_prefix}results", "enable.auto.commit": False}
        ))
        self._pending: dict[str, asyncio.Future[Message]] = {}
        self._timed_out: OrderedDict[str, None] = OrderedDict()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._consume, name="result-waiter", daemon=True)
        self.duplicates = 0

    def start(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        """Positions the consumer at the end of every partition, then starts reading. The end
        offsets are asked now: positioned at "the end" when its first fetch starts, it would skip
        results appended meanwhile, to requests sent right after the start."""
        client_or_config_error(lambda: self._assign_at_end(timeout_s), "kafka.bootstrap_servers")
        self._loop = loop
        self._thread.start()

    def _assign_at_end(self, timeout_s: float) -> None:
        partitions = self._consumer.list_topics(self.topic, timeout=timeout_s).topics[self.topic].partitions
        if not partitions:
            raise RuntimeError(f"result topic {self.topic!r} has no partitions (does it exist?)")
        self._consumer.assign(end_offsets(self._consumer, self.topic, timeout_s))

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
                records = fetched(self._consumer, CONSUME_WAIT_S)
            except Exception:  # librdkafka retries a broker gone away itself: this is not that
                log.exception("reading %s failed; retrying", self.topic)
                self._stop.wait(1.0)
                continue
            results = [self._decode(record.key(), record.value()) for record in records if not self._failed(record)]
            ours = [result for result in results if result is not None]
            if ours:  # one wake-up of the event loop per poll, not one per result
                assert self._loop is not None
                self._loop.call_soon_threadsafe(self._complete, ours)

    def _failed(self, record: Record) -> bool:
        """A record that is an error event rather than a result (librdkafka retries by itself)."""
        error = record.error()
        if error is not None:
            log.warning("reading %s: %s", self.topic, error.str())
        return error is not None

    def _decode(self, key: bytes | None, value: bytes | None) -> tuple[str, Message] | None:
        """(uri, result) for a result of this bridge's; None for others' results."""
        uri = key.decode(errors="replace") if key else ""
        if not uri.startswith(self.uri_prefix):
            return None
        try:
            return uri, decode_message(value or b"", KAFKA_RECORD_BYTES)
        except DecodeError as exc:
            return uri, Message(uri, error=f"unreadable result: {exc}", error_code="internal")

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

