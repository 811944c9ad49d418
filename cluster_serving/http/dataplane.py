"""The bridge's transport-neutral core: enqueue instances with fresh uris, await their results.

`Bridge` owns the Kafka producer, the single result-topic reader (`ResultWaiter`), the metrics,
the limits, the rate limit, the readiness check and the models served (`bridge.catalog`). It knows
no HTTP: it takes instances already read from a request, for a model version resolved by the
catalog, and raises `bridge.errors` for what it refuses, and each protocol's router
(`bridge.protocol`) turns its requests into calls on it and the errors into its own answers.

The model and version a request names travel to the job as the Kafka record headers `model`
(UTF-8 name) and `version` (decimal text, absent when the request names none: the newest the job
serves); the result says which version served it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cluster_serving.config import JOB_NAME, ConfigError, ServingConfig
from cluster_serving.http.catalog import Catalog, Target
from cluster_serving.http.errors import (
    InvalidRequest,
    NotReady,
    RateLimited,
    Timeout,
    TooLarge,
    Unavailable,
    result_error,
)
from cluster_serving.http.metrics import BridgeMetrics
from cluster_serving.http.result_waiter import ResultWaiter
from cluster_serving.kafka.admin import READ_COMMITTED, broker_reachable, ensure_topics
from cluster_serving.kafka.clients import RequestProducer, librdkafka_settings
from cluster_serving.kafka.librdkafka import CONSUMER_DEFAULTS
from cluster_serving.net.flink_rest import FlinkRest
from cluster_serving.wire.codec import Message
from cluster_serving.wire.inputs import deadline_headers, encode_request

log = logging.getLogger("cluster_serving.http")
READINESS_TTL_S = 1.0
READINESS_STALE_S = 3.0
# Waits for the broker's metadata at start, and for queued records at stop.
CONNECT_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0
@dataclass(frozen=True)
class Request:
    """One predict request's instances and the model version they are for."""

    target: Target
    instances: list[dict[str, Any]]


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
    """The served models behind the Kafka topics, for any number of protocol fronts."""

    def __init__(self, config: ServingConfig):
        self.config = config
        self.catalog = Catalog(config)  # reads and checks every served version first
        self.metrics = BridgeMetrics()
        self.token = bearer_token(config.http.token_env)
        http = config.http
        self.limiter = TokenBucket(http.rate_limit_per_s, http.rate_limit_burst) if http.rate_limit_per_s else None
        self.uri_prefix = f"http-{uuid.uuid4().hex[:12]}-"
        self._sequence = itertools.count()
        self._ready: tuple[float, str | None] | None = None  # (checked at, reason)
        self._checking: asyncio.Task[None] | None = None
        self.producer: RequestProducer | None = None
        self.waiter: ResultWaiter | None = None

    async def start(self) -> None:
        """Creates missing topics, connects the producer and puts the result reader at the end."""
        # Made first: it refuses a kafka.properties name librdkafka does not know before any topic is made.
        self.producer = RequestProducer(self.config.kafka, self.config.http.request_timeout_s)
        await asyncio.to_thread(ensure_topics, self.config.kafka)
        await asyncio.to_thread(self._connect, self.producer, asyncio.get_running_loop())

    def _connect(self, producer: RequestProducer, loop: asyncio.AbstractEventLoop) -> None:
        kafka = self.config.kafka
        producer.connect(kafka.input_topic, CONNECT_TIMEOUT_S)
        self.waiter = ResultWaiter(
            librdkafka_settings(kafka, **{**CONSUMER_DEFAULTS, "isolation.level": READ_COMMITTED}),
            kafka.result_topic, self.uri_prefix, self.metrics.count_late_result,
        )
        self.waiter.start(loop, CONNECT_TIMEOUT_S)

    async def stop(self) -> None:
        if self.waiter:
            await asyncio.to_thread(self.waiter.stop)
        if self.producer:
            await asyncio.to_thread(self.producer.close, STOP_TIMEOUT_S)

    async def not_ready_reason(self) -> str | None:
        """None when requests can be served: broker connected, result reader alive, job running.

        Checked at most once a second, in the background: requests take the last check's answer
        rather than queue behind a call to Flink (milliseconds, every second, for every request
        that came meanwhile). The first check is waited for, and so is one after a quiet spell
        (READINESS_STALE_S): an answer that old would let the first request after an outage
        wait for its timeout instead of being refused."""
        age = math.inf if self._ready is None else time.monotonic() - self._ready[0]
        if self._checking is None and age > READINESS_TTL_S:
            self._checking = asyncio.create_task(self._check())
        if age > READINESS_STALE_S:
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
        job = FlinkRest(self.config.http.flink_rest_url, timeout_s=2).find_job(JOB_NAME)
        if isinstance(job, str):
            return job
        if job["state"] != "RUNNING":
            return f"no running {JOB_NAME!r} job on {self.config.http.flink_rest_url} (the newest is {job['state']})"
        return None

    async def require_ready(self) -> None:
        """Raises NotReady, saying why, unless requests can be served now."""
        reason = await self.not_ready_reason()
        if reason:
            raise NotReady(f"not ready: {reason}")

    @property
    def model_name(self) -> str:
        """The default model: what BigDL's /predict and requests naming no model get."""
        return self.catalog.default

    async def target(self, model: str | None = None, version: str | None = None) -> Target:
        """The model version a request names (None: the default model, its newest version);
        ModelNotFound, naming what is served, for one the repository does not serve."""
        return await self.catalog.find(model, version)

    def admit(self) -> None:
        """Applies the rate limit to one predict request."""
        if self.limiter is not None and not self.limiter.take():
            raise RateLimited("rate limit exceeded, retry later")

    def check_instance_count(self, count: int) -> None:
        """Refuses a request of more instances than `http.max_instances`."""
        limit = self.config.http.max_instances
        if count > limit:
            raise TooLarge(f"{count} instances, over the limit of {limit}")

    async def predict(
        self, target: Target, read: Callable[[], list[dict[str, Any]]], count: int | None = None
    ) -> list[Message]:
        """One predict request of any protocol for `target`, checked in the order every protocol
        answers it: the rate limit; the instance count, where the protocol knows it before reading
        them; then, timed as the request (in total and per model version), `read` (the protocol's
        reading of its instances) and `infer`."""
        self.admit()
        if count is not None:
            self.check_instance_count(count)
        started = time.perf_counter()
        results: list[Message] = []
        try:
            with self.metrics.time_request():
                results = await self.infer(Request(target, read()))
            return results
        finally:
            served = results[0].model_version if results and results[0].model_version is not None else None
            version = target.version_label if served is None else str(served)
            self.metrics.record_model_request(target.model, version, time.perf_counter() - started, ok=bool(results))

    async def infer(self, request: Request) -> list[Message]:
        """Enqueues each instance under a fresh uri, with the bridge's timeout as its deadline (the
        job does not run what nobody waits for), and returns their results in order; the first
        error result fails the whole request."""
        await self.require_ready()
        instances = request.instances
        headers = request.target.headers + deadline_headers(self.config.http.request_timeout_s)
        with self.metrics.time_enqueue():
            records = [(f"{self.uri_prefix}{next(self._sequence)}", data) for data in instances]
            payloads = [self._encode(i, uri, data) for i, (uri, data) in enumerate(records)]
        assert self.waiter is not None and self.producer is not None
        futures = [self.waiter.expect(uri) for uri, _ in records]
        try:
            for (uri, _), payload in zip(records, payloads):
                self._send(uri, payload, headers)
            with self.metrics.time_wait_result():
                timeout = self.config.http.request_timeout_s
                try:
                    async with asyncio.timeout(timeout):  # one timer; wait_for(gather()) added two futures
                        messages = [await future for future in futures]
                except TimeoutError:
                    raise Timeout(f"no result within {timeout:g} s") from None
        finally:
            for uri, _ in records:
                self.waiter.forget(uri)
        return [self._result(i, message) for i, message in enumerate(messages)]

    def _encode(self, index: int, uri: str, data: dict[str, Any]) -> bytes:
        try:
            payload = encode_request(uri, data)
        except (ValueError, OSError) as exc:
            raise InvalidRequest(f"instance {index}: {exc}") from None
        limit = self.config.limits.max_instance_bytes
        if len(payload) > limit:
            raise TooLarge(f"instance {index}: {len(payload)} bytes encoded, over the limit of {limit}")
        return payload

    def _send(self, uri: str, payload: bytes, headers: list[tuple[str, bytes]]) -> None:
        assert self.producer is not None and self.waiter is not None
        loop, waiter = asyncio.get_running_loop(), self.waiter

        def failed(reason: str) -> None:
            loop.call_soon_threadsafe(waiter.fail, uri, Unavailable(f"could not enqueue the request: {reason}"))

        try:
            self.producer.send(self.config.kafka.input_topic, uri.encode(), payload, headers, failed)
        except Exception as exc:  # BufferError: librdkafka's queue is full
            raise Unavailable(f"could not enqueue the request: {exc}") from None

    def _result(self, index: int, message: Message) -> Message:
        if message.inference_us is not None:
            self.metrics.record_inference_us(message.inference_us, message.model, message.model_version)
        if message.error is not None:
            raise result_error(message.error_code)(f"instance {index}: {message.error}")
        return message


def bearer_token(env_name: str) -> str | None:
    """The token from the environment variable the config names; named but empty is an error."""
    if not env_name:
        return None
    token = os.environ.get(env_name, "")
    if not token:
        raise ConfigError(f"http.token_env: environment variable {env_name} is not set or empty")
    return token
