"""The serving state behind the HTTP routes: enqueue instances with fresh uris, await their results.

`Bridge` owns the Kafka producer, the single result-topic reader (`ResultWaiter`), the metrics,
the rate limit and the readiness check; `bridge.server` only turns HTTP into calls on it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

from kafka import KafkaProducer
from kafka.errors import KafkaError

from bridge.metrics import BridgeMetrics
from bridge.http_json import RequestError
from connectors.inputs import encode_request
from bridge.model_info import read_signature
from ops.operations import flink_job
from bridge.result_waiter import ResultWaiter
from conf import JOB_NAME, KAFKA_RECORD_BYTES, ConfigError, ServingConfig
from connectors.admin import READ_COMMITTED, broker_reachable, client_properties, ensure_topics
from connectors.codec import Message

log = logging.getLogger("cluster_serving.bridge")
READINESS_TTL_S = 1.0
# Error results the job writes for its own failures; all others are about the request.
SERVER_SIDE_ERRORS = ("inference failed", "postprocess failed", "result not encodable", "unreadable result")


class TokenBucket:
    """Allows `rate` requests per second on average and bursts of up to `burst`."""

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, burst
        self.tokens = float(burst)
        self.updated = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class Bridge:
    def __init__(self, config: ServingConfig):
        self.config = config
        self.model_name = config.model.name
        self.signature = read_signature(config.model.path, config.model.outputs)
        self.image_inputs = frozenset(config.preprocess.images)
        self.metrics = BridgeMetrics()
        self.token = bearer_token(config.http.token_env)
        http = config.http
        self.limiter = TokenBucket(http.rate_limit_per_s, http.rate_limit_burst) if http.rate_limit_per_s else None
        self.uri_prefix = f"http-{uuid.uuid4().hex[:12]}-"
        self._sequence = itertools.count()
        self._partitions: Iterator[int] = itertools.repeat(0)  # the input topic's, once connected
        self._ready: tuple[float, str | None] | None = None  # (checked at, reason)
        self._checking: asyncio.Task[None] | None = None
        self.producer: KafkaProducer | None = None
        self.waiter: ResultWaiter | None = None

    async def start(self) -> None:
        """Creates missing topics, connects the producer and puts the result reader at the end."""
        kafka = self.config.kafka
        await asyncio.to_thread(ensure_topics, kafka)
        try:
            await asyncio.to_thread(self._connect, asyncio.get_running_loop())
        except KafkaError as exc:
            raise ConfigError(f"kafka.bootstrap_servers: {kafka.bootstrap_servers}: {exc}") from None

    def _connect(self, loop: asyncio.AbstractEventLoop) -> None:
        kafka = self.config.kafka
        properties = client_properties(kafka)
        self.producer = KafkaProducer(
            bootstrap_servers=kafka.bootstrap_servers, linger_ms=1, acks="all",
            # The producer's 1 MiB default would refuse large instances before the job could.
            max_request_size=KAFKA_RECORD_BYTES,
            # kafka-python's own metrics, read by nobody here, cost a third of each produce request.
            metrics_enabled=False,
            **properties,
        )
        # Round robin, as the key hash would spread these unique uris anyway: kafka-python's key
        # hash (murmur2) is pure Python, a fifth of each send's time.
        self._partitions = itertools.cycle(sorted(self.producer.partitions_for(kafka.input_topic)))
        self.waiter = ResultWaiter(
            kafka.bootstrap_servers, kafka.result_topic, self.uri_prefix, self.metrics.late_results.inc,
            isolation_level=READ_COMMITTED, metrics_enabled=False, **properties,
        )
        self.waiter.start(loop)

    async def stop(self) -> None:
        if self.waiter:
            await asyncio.to_thread(self.waiter.stop)
        if self.producer:
            await asyncio.to_thread(self.producer.close, 5)

    async def not_ready_reason(self) -> str | None:
        """None when requests can be served: broker connected, result reader alive, job running.

        Checked at most once a second, in the background: requests take the last check's answer
        rather than queue behind a call to Flink (milliseconds, every second, for every request
        that came meanwhile). Only the first check is waited for."""
        if self._checking is None and (self._ready is None or time.monotonic() - self._ready[0] > READINESS_TTL_S):
            self._checking = asyncio.create_task(self._check())
        if self._ready is None:
            assert self._checking is not None
            await asyncio.shield(self._checking)  # requests cancelled meanwhile leave the check running
        assert self._ready is not None
        return self._ready[1]

    async def _check(self) -> None:
        try:
            self._ready = (time.monotonic(), await asyncio.to_thread(self._check_ready))
        finally:
            self._checking = None

    def _check_ready(self) -> str | None:
        if self.producer is None or self.waiter is None or not self.waiter.alive:
            return "the bridge is not connected to Kafka"
        if not broker_reachable(self.config.kafka.bootstrap_servers):
            return f"no Kafka broker reachable at {self.config.kafka.bootstrap_servers}"
        job = flink_job(self.config.http.flink_rest_url, timeout_s=2)
        if isinstance(job, str):
            return job
        if job["state"] != "RUNNING":
            return f"no running {JOB_NAME!r} job on {self.config.http.flink_rest_url} (the newest is {job['state']})"
        return None

    def admit(self) -> None:
        """Applies the rate limit to one predict request."""
        if self.limiter is not None and not self.limiter.take():
            raise RequestError("rate limit exceeded, retry later", 429)

    async def infer(self, instances: list[dict[str, Any]]) -> list[Message]:
        """Enqueues each instance under a fresh uri and returns their results in order; the first
        error result fails the whole request."""
        reason = await self.not_ready_reason()
        if reason:
            raise RequestError(f"not ready: {reason}", 503)
        with self.metrics.enqueue.time():
            records = [(f"{self.uri_prefix}{next(self._sequence)}", data) for data in instances]
            payloads = [self._encode(i, uri, data) for i, (uri, data) in enumerate(records)]
        assert self.waiter is not None and self.producer is not None
        futures = [self.waiter.expect(uri) for uri, _ in records]
        try:
            for (uri, _), payload in zip(records, payloads):
                self._send(uri, payload)
            with self.metrics.wait_result.time():
                timeout = self.config.http.request_timeout_s
                try:
                    async with asyncio.timeout(timeout):  # one timer; wait_for(gather()) added two futures
                        messages = [await future for future in futures]
                except TimeoutError:
                    raise RequestError(f"no result within {timeout:g} s", 504) from None
                except KafkaError as exc:
                    raise RequestError(f"could not enqueue the request: {exc}", 503) from None
        finally:
            for uri, _ in records:
                self.waiter.forget(uri)
        return [self._result(i, message) for i, message in enumerate(messages)]

    def _encode(self, index: int, uri: str, data: dict[str, Any]) -> bytes:
        try:
            payload = encode_request(uri, data)
        except (ValueError, OSError) as exc:
            raise RequestError(f"instance {index}: {exc}") from None
        limit = self.config.limits.max_instance_bytes
        if len(payload) > limit:
            raise RequestError(f"instance {index}: {len(payload)} bytes encoded, over the limit of {limit}", 413)
        return payload

    def _send(self, uri: str, payload: bytes) -> None:
        assert self.producer is not None and self.waiter is not None
        loop, waiter = asyncio.get_running_loop(), self.waiter
        try:
            sent = self.producer.send(
                self.config.kafka.input_topic, key=uri.encode(), value=payload, partition=next(self._partitions)
            )
        except Exception as exc:
            raise RequestError(f"could not enqueue the request: {exc}", 503) from None
        sent.add_errback(lambda exc: loop.call_soon_threadsafe(waiter.fail, uri, exc))

    def _result(self, index: int, message: Message) -> Message:
        if message.inference_us is not None:
            self.metrics.record_inference_us(message.inference_us)
        if message.error is not None:
            status = 500 if message.error.startswith(SERVER_SIDE_ERRORS) else 400
            raise RequestError(f"instance {index}: {message.error}", status)
        return message


def bearer_token(env_name: str) -> str | None:
    """The token from the environment variable the config names; named but empty is an error."""
    if not env_name:
        return None
    token = os.environ.get(env_name, "")
    if not token:
        raise ConfigError(f"http.token_env: environment variable {env_name} is not set or empty")
    return token
