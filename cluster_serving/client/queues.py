"""What users import: InputQueue puts requests on the input topic, OutputQueue reads results.

    from cluster_serving.client import InputQueue, OutputQueue
    InputQueue(bootstrap_servers="127.0.0.1:9092").enqueue("img-1", image={"path": "cat.jpg"})
    InputQueue(bootstrap_servers="127.0.0.1:9092").enqueue("img-2", model="resnet", version=2, image=...)
    OutputQueue(bootstrap_servers="127.0.0.1:9092").query("img-1", timeout=5)
    InputQueue(sync=True, frontend_url="http://127.0.0.1:10020").predict('{"instances": [...]}')
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import sys
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    IsolationLevel,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, OffsetSpec

from cluster_serving.config import KAFKA_RECORD_BYTES, defaults
from cluster_serving.kafka.admin import READ_COMMITTED, LagProbe
from cluster_serving.kafka.librdkafka import (
    CONSUMER_DEFAULTS,
    client_settings,
    committed_offsets,
    fetched,
    gc_paused,
    keyword_settings,
    produce_waiting,
    topic_partitions,
)
from cluster_serving.wire.codec import DecodeError, decode_message
from cluster_serving.wire.inputs import (
    PROTOCOLS,
    Headers,
    Result,
    checked_model,
    encode_alike_requests,
    encode_oip_request,
    encode_request,
    protocol_headers,
    request_headers,
    result_of,
)
from cluster_serving.wire.open_inference import decode_answer

log = logging.getLogger(__name__)
Client = TypeVar("Client")

# The job's own defaults (cluster_serving/config/config.yaml), so a client with no arguments finds a default job.
JOB_KAFKA = defaults().kafka
DEFAULT_CLIENT_GROUP = "cluster-serving-client"
PROGRESS_EVERY_S = 1.0
# The queue-full guard asks Kafka for the lag at most this often (it costs three requests).
LAG_CHECK_EVERY_S = 0.5
WHEN_FULL = ("block", "refuse")


class QueueFullError(RuntimeError):
    """The input topic's lag is over `max_lag`: the job is that far behind (BigDL's queue-full)."""


class PredictError(RuntimeError):
    """The HTTP bridge refused a `predict` request; `status` is its HTTP status."""

    def __init__(self, message: str, status: int):
        super().__init__(f"{status}: {message}")
        self.status = status


# librdkafka (confluent-kafka) rather than kafka-python, which builds every record in Python.
# The settings' names are Kafka's; the user's keywords come after them.
PRODUCER_SETTINGS = {
    "acks": "all",
    "linger.ms": 1,
    "message.max.bytes": KAFKA_RECORD_BYTES,
    # Kafka's own producers give a record up after 2 minutes (delivery.timeout.ms); librdkafka's
    # default is 5.
    "message.timeout.ms": 120_000,
    # Only failures come back to Python (one call per record otherwise).
    "delivery.report.only.error": True,
}
# Uris a DeliveryError names (it counts them all).
NAMED_FAILURES = 5
# Requests of enqueue_batch encoded together when alike (connectors.inputs.encode_alike_requests).
ENCODE_TOGETHER = 256
CONSUMER_SETTINGS = {
    **CONSUMER_DEFAULTS,
    "enable.auto.commit": False,
    "auto.offset.reset": "earliest",
    "isolation.level": READ_COMMITTED,
    # Reaching a partition's end is an event, so dequeue() knows when it has read all there was.
    "enable.partition.eof": True,
}
# How long metadata and offset questions wait for the broker.
METADATA_TIMEOUT_S = 30.0
# How long a send waits for librdkafka to write some records when its queue is full.
QUEUE_FULL_WAIT_S = 0.05
# What librdkafka's admin client answers, again and again, once the broker it knew has been away
# and come back: it asks with the partitions' old leaders, or finds none in its old metadata.
STALE_METADATA = {
    KafkaError.FENCED_LEADER_EPOCH, KafkaError.UNKNOWN_LEADER_EPOCH, KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError._NOENT,
}
# flush() waits in steps this long, so that it gives up at once when the broker refuses this client.
FLUSH_STEP_S = 0.5


def refused_as_value_error(make: Callable[[], Client]) -> Client:
    """The librdkafka client `make` builds, or its refusal of a setting as one ValueError line."""
    try:
        return make()
    except KafkaException as exc:
        raise ValueError(f"Kafka settings: {exc.args[0].str()} (keywords are Kafka's setting names with "
                         "underscores for dots, e.g. security_protocol)") from None


class DeliveryError(RuntimeError):
    """Requests Kafka did not take: the broker refused them or this client (its credentials or
    TLS settings), or none was reachable for message.timeout.ms (2 minutes)."""


class InputQueue:
    """Sends requests: `enqueue(uri, **inputs)`, one Kafka record per request, key = uri, the
    model and version it names (if any) in the record's headers `model` and `version`; or, with
    `sync=True`, `predict(request_json)` through the HTTP bridge at `frontend_url`.

    With `max_lag`, enqueue first checks how far the job (consumer group `job_group_id`) is behind
    on the input topic; at `max_lag` records or more it blocks until the job catches up (at most
    `block_timeout_s`) or, with `when_full="refuse"`, raises QueueFullError at once.

    `protocol` says how requests are written: "native" (this format, the fastest), or as the
    peers that serve over Kafka write them, each answered in kind: "mlserver" (Seldon MLServer's
    JSON InferenceRequest, headers mlserver-model / mlserver-version), "oip-json" or
    "oip-protobuf" (Seldon Core 2's ModelInferRequest, header seldon-infer-type). In those, an
    input is the whole tensor as the protocol has it: batch dimension included where the model has one.

    Other keywords are Kafka settings with underscores for dots (`security_protocol`,
    `sasl_mechanism`, `sasl_username`, `linger_ms`, ...), for its librdkafka producer and the
    queue-full guard's reader. With `transactional_id`, requests go in transactions
    (`with queue.transaction(): ...`), each seen by the job whole once committed, or never."""

    def __init__(
        self,
        bootstrap_servers: str = JOB_KAFKA.bootstrap_servers,
        topic: str = JOB_KAFKA.input_topic,
        *,
        host: str | None = None,
        port: int | None = None,
        sync: bool = False,
        frontend_url: str | None = None,
        max_lag: int | None = None,
        when_full: str = "block",
        block_timeout_s: float = 60.0,
        job_group_id: str = JOB_KAFKA.group_id,
        protocol: str = "native",
        **kafka: Any,
    ):
        if host is not None:  # BigDL's way of naming the broker
            bootstrap_servers = f"{host}:{port or 9092}"
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
        self.topic, self.protocol = topic, protocol
        self.frontend_url = frontend_url.rstrip("/") if frontend_url else None
        if sync and not self.frontend_url:
            raise ValueError("sync=True needs frontend_url, the HTTP bridge's address")
        self._refused: str | None = None  # why the broker refuses this client, once it has
        settings = {**PRODUCER_SETTINGS, **keyword_settings(kafka)}
        self._bootstrap_servers = bootstrap_servers
        self._message_timeout_ms = settings.get("delivery.timeout.ms", settings["message.timeout.ms"])
        self._transactional = "transactional.id" in settings
        if self._transactional:  # librdkafka wants a transaction to outlive a record's delivery
            settings.setdefault("transaction.timeout.ms", self._message_timeout_ms)
        self._producer = None if sync else refused_as_value_error(lambda: Producer(client_settings(
            bootstrap_servers, settings,
            log, "requests wait in the producer until one is back", refused=self._refuse, on_delivery=self._not_delivered,
        )))
        self._failed: list[tuple[str, str]] = []  # (uri, why), since the last flush
        self._closed = False
        self._transactions_ready = self._in_transaction = False
        if when_full not in WHEN_FULL:
            raise ValueError(f"when_full must be one of {WHEN_FULL}, got {when_full!r}")
        self.max_lag, self.when_full, self.block_timeout_s = max_lag, when_full, block_timeout_s
        self._lag_probe = refused_as_value_error(lambda: LagProbe(
            bootstrap_servers, topic, job_group_id, keyword_settings(kafka))) if max_lag and not sync else None
        self._lag_checked = (-1.0, 0)  # (when, lag)

    def enqueue(self, uri: str, model: str | None = None, version: int | None = None, timeout: float | None = None,
                **data: Any) -> None:
        """Queues one request; returns once it is handed to the producer (call flush() to wait).
        Each other keyword is one input: a list of str, an image {'path'|'b64': ...}, an ndarray,
        or a sparse tensor [indices, values, shape].

        `model` names the model of the repository that serves it (None: the default one) and
        `version` its version (None: the newest one served); a bad name or version raises
        ValueError before anything is sent. `timeout` (seconds) gives the request a deadline: one
        whose batch forms after it is answered `deadline_exceeded` without running the model.
        `model`, `version` and `timeout` are therefore reserved keyword names here: send inputs
        called that way with enqueue_batch([(uri, {"model": ...})])."""
        headers = self._headers(model, version, timeout)
        self._check_not_sync()
        self._send(uri, self._encode(uri, data), headers)

    def enqueue_batch(
        self,
        requests: Iterable[tuple[str, Mapping[str, Any]]],
        progress: bool = False,
        model: str | None = None,
        version: int | None = None,
        timeout: float | None = None,
    ) -> int:
        """Queues many (uri, inputs) requests with one flush at the end; returns how many. With
        `progress`, prints how many are queued every second and at the end (to stderr). `model`
        and `version` (see enqueue) apply to every request; inputs may have any names here,
        `model` and `version` included. `timeout` (see enqueue) counts from when each request is
        queued."""
        headers = self._headers(model, version, timeout)
        self._check_not_sync()
        count, started, shown = 0, time.monotonic(), time.monotonic()
        pending = iter(requests)
        while chunk := list(itertools.islice(pending, ENCODE_TOGETHER)):
            if timeout is not None:
                headers = self._headers(model, version, timeout)
            payloads = encode_alike_requests(chunk) if self.protocol == "native" else None
            for i, (uri, data) in enumerate(chunk):
                self._send(uri, self._encode(uri, data) if payloads is None else payloads[i], headers)
            count += len(chunk)
            if progress and time.monotonic() - shown >= PROGRESS_EVERY_S:
                shown = time.monotonic()
                print(f"enqueued {count} requests ({count / (shown - started):.0f}/s)", file=sys.stderr)
        self.flush()
        if progress:
            elapsed = max(time.monotonic() - started, 1e-9)
            print(f"enqueued {count} requests in {elapsed:.1f} s ({count / elapsed:.0f}/s), flushed", file=sys.stderr)
        return count

    def _headers(self, model: str | None, version: int | None, timeout: float | None) -> Headers | None:
        """The record headers of a request in this queue's protocol."""
        headers = request_headers(model, version, timeout)
        return headers if self.protocol == "native" else protocol_headers(self.protocol, headers or [])

    def _encode(self, uri: str, data: Mapping[str, Any]) -> bytes:
        if self.protocol == "native":
            return encode_request(uri, data)
        return encode_oip_request(self.protocol, uri, data)

    def _send(self, uri: str, payload: bytes, headers: Headers | None) -> None:
        """Hands one encoded request to librdkafka, waiting while its queue is full."""
        self._raise_if_refused()
        if self._lag_probe is not None:
            self._wait_for_room()
        try:
            produce_waiting(self._producer, self.topic, payload, uri.encode(), QUEUE_FULL_WAIT_S,
                            self._raise_if_refused, headers=headers)
        except KafkaException as exc:
            if exc.args[0].code() == KafkaError.MSG_SIZE_TOO_LARGE:
                raise ValueError(f"request {uri!r} is {len(payload)} bytes encoded, over Kafka's record "
                                 f"limit of {KAFKA_RECORD_BYTES}") from None
            raise
        self._producer.poll(0)

    def _refuse(self, why: str) -> None:
        self._refused = why

    def _raise_if_refused(self) -> None:
        if self._refused is not None:
            raise DeliveryError(f"requests to topic {self.topic!r} cannot be written: {self._refused}")

    def _not_delivered(self, error: KafkaError, message: Any) -> None:
        why = error.str()
        if error.code() == KafkaError._MSG_TIMED_OUT:
            why = f"no broker took them within message.timeout.ms ({self._message_timeout_ms} ms): is Kafka at {self._bootstrap_servers} reachable?"
        self._failed.append((message.key().decode(errors="replace"), why))

    def _check_not_sync(self) -> None:
        if self._producer is None:
            raise RuntimeError("this InputQueue was made with sync=True: use predict(), not enqueue()")
        if self._transactional and not self._in_transaction:
            raise RuntimeError("this InputQueue has a transactional_id: enqueue inside `with queue.transaction():`")

    @contextmanager
    def transaction(self, timeout: float = 60.0) -> Iterator[None]:
        """The requests enqueued in the block are committed together when it ends, or aborted
        if it raises: the job (reading committed records only) serves all of them, or none.
        Needs a queue made with `transactional_id` (Kafka's transactional.id, one per writer)."""
        if self._producer is None or not self._transactional:
            raise RuntimeError("transaction() needs an InputQueue made with transactional_id=... (and not sync=True)")
        if not self._transactions_ready:
            self._producer.init_transactions(timeout)
            self._transactions_ready = True
        self._producer.begin_transaction()
        self._in_transaction = True
        try:
            yield
            self.flush(timeout)
        except BaseException:
            self._failed = []
            self._producer.abort_transaction(timeout)
            raise
        else:
            self._producer.commit_transaction(timeout)
        finally:
            self._in_transaction = False

    def lag(self) -> int:
        """The job's lag on the input topic, as last measured (at most LAG_CHECK_EVERY_S old)."""
        if self._lag_probe is None:
            raise RuntimeError("lag() needs InputQueue(max_lag=...)")
        checked, lag = self._lag_checked
        if time.monotonic() - checked >= LAG_CHECK_EVERY_S:
            self._producer.flush()  # what this queue sent counts too
            lag = self._lag_probe.lag()
            self._lag_checked = (time.monotonic(), lag)
        return lag

    def _wait_for_room(self) -> None:
        assert self.max_lag is not None
        deadline = time.monotonic() + self.block_timeout_s
        while (lag := self.lag()) >= self.max_lag:
            if self.when_full == "refuse" or time.monotonic() >= deadline:
                waited = "" if self.when_full == "refuse" else f" after waiting {self.block_timeout_s:g} s"
                raise QueueFullError(f"input topic {self.topic!r} lag {lag} >= max_lag {self.max_lag}{waited}")
            time.sleep(LAG_CHECK_EVERY_S)

    def predict(self, request: str | Mapping[str, Any], timeout: float = 60.0, model: str | None = None) -> list[Any]:
        """Sends `{"instances": [...]}` (JSON text or a dict) to the bridge's /predict (the default
        model) or, with `model`, to its KServe v1 route /v1/models/<model>:predict, and returns the
        predictions, one per instance; a refused request raises PredictError. Both serve the newest
        version; to name a version, use enqueue(version=...) or the bridge's v2 routes."""
        if not self.frontend_url:
            raise RuntimeError("predict() needs InputQueue(sync=True, frontend_url=...)")
        route = "/predict" if model is None else f"/v1/models/{checked_model(model)}:predict"
        body = request.encode() if isinstance(request, str) else json.dumps(request).encode()
        call = urllib.request.Request(
            f"{self.frontend_url}{route}", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(call, timeout=timeout) as response:
                return json.load(response)["predictions"]
        except urllib.error.HTTPError as error:
            raise PredictError(_error_text(error.read()), error.code) from None

    def flush(self, timeout: float | None = None) -> None:
        """Waits until every request sent is written to Kafka (at most `timeout` seconds: then
        TimeoutError); DeliveryError names those Kafka did not take."""
        if self._producer is None:
            return
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        while left := self._producer.flush(max(0.0, min(FLUSH_STEP_S, deadline - time.monotonic()))):
            self._raise_if_refused()
            if time.monotonic() >= deadline:
                break
        failed, self._failed = self._failed, []
        if failed:
            named = ", ".join(repr(uri) for uri, _ in failed[:NAMED_FAILURES]) + (" ..." if len(failed) > NAMED_FAILURES else "")
            raise DeliveryError(f"{len(failed)} requests not written to topic {self.topic!r} ({named}): {failed[0][1]}")
        if left:
            raise TimeoutError(f"{left} requests not yet written to topic {self.topic!r} after {timeout:g} s")

    def close(self) -> None:
        """Writes what is queued, then lets go of the broker; once is enough, more do nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
        finally:
            if self._producer is not None:
                self._producer.close()
            if self._lag_probe is not None:
                self._lag_probe.close()

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


def _error_text(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")


class OutputQueue:
    """Reads results: `query(uri, timeout)` waits for one, `dequeue()` takes all that are there.
    A result is a dict (connectors.inputs.Result) whose `.model` and `.version` name what served it.

    It reads every partition of the result topic itself (no consumer-group rebalancing) and keeps
    its position as the committed offset of `group_id`, moved forward by `dequeue()`. Other
    keywords are Kafka consumer settings with underscores for dots, as InputQueue's.
    """

    def __init__(
        self,
        bootstrap_servers: str = JOB_KAFKA.bootstrap_servers,
        topic: str = JOB_KAFKA.result_topic,
        group_id: str = DEFAULT_CLIENT_GROUP,
        **kafka: Any,
    ):
        self.topic = topic
        self.store = ResultStore()
        self._bootstrap_servers, self._settings = bootstrap_servers, keyword_settings(kafka)
        self._refused: str | None = None  # why the broker refuses this client, once it has
        self._consumer = refused_as_value_error(lambda: Consumer(client_settings(
            bootstrap_servers, {**CONSUMER_SETTINGS, "group.id": group_id, **self._settings}, log,
            "results wait until one is back", refused=self._refuse,
        )))
        self._partitions: list[TopicPartition] = []
        self._next: dict[int, int] = {}  # partition -> the offset after the last record or end seen

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
            ends = self._readable_ends()
            with gc_paused():
                while any(self._next.get(partition, -1) < end for partition, end in ends.items()):
                    self._poll(0.05)
        results = self.store.take_all()
        if self._next:
            self._consumer.commit(offsets=[TopicPartition(self.topic, partition, offset)
                                           for partition, offset in self._next.items()], asynchronous=False)
        return results

    @functools.cached_property
    def _admin(self) -> AdminClient:
        """Made at the first dequeue(): a reader that only queries needs none."""
        return AdminClient(client_settings(self._bootstrap_servers, self._settings, log, "dequeue() waits until one is back"))

    def _readable_ends(self) -> dict[int, int]:
        """Each partition's end as a read_committed reader sees it now: results of transactions
        still open (kafka.delivery exactly_once) are not waited for."""
        try:
            return self._ask_ends()
        except KafkaException as exc:
            if exc.args[0].code() not in STALE_METADATA:
                raise
            del self._admin  # a new client asks with fresh metadata
            return self._ask_ends()

    def _ask_ends(self) -> dict[int, int]:
        asked = self._admin.list_offsets({partition: OffsetSpec.latest() for partition in self._partitions},
                                         isolation_level=IsolationLevel.READ_COMMITTED, request_timeout=METADATA_TIMEOUT_S)
        return {partition.partition: answer.result().offset for partition, answer in asked.items()}

    def _assign(self) -> bool:
        """Reads every partition of the topic, once it exists, from the group's committed offset,
        else from the start."""
        if not self._partitions:
            partitions = self._known_partitions()
            if partitions:
                self._consumer.assign([
                    TopicPartition(self.topic, partition.partition, partition.offset if partition.offset >= 0 else OFFSET_BEGINNING)
                    for partition in committed_offsets(self._consumer, partitions, METADATA_TIMEOUT_S)
                ])
                self._partitions = partitions
        return bool(self._partitions)

    def _known_partitions(self) -> list[TopicPartition]:
        """The topic's partitions, asked a second at a time for up to METADATA_TIMEOUT_S, so that
        a broker refusing this client is said at once rather than after the whole wait."""
        deadline = time.monotonic() + METADATA_TIMEOUT_S
        while True:
            try:
                return topic_partitions(self._consumer, self.topic, 1.0)
            except KafkaException:
                self._consumer.poll(0)  # not reading yet: this only serves the callback that says why
                self._raise_if_refused()
                if time.monotonic() >= deadline:
                    raise

    def _refuse(self, why: str) -> None:
        self._refused = why

    def _raise_if_refused(self) -> None:
        if self._refused is not None:
            raise ConnectionRefusedError(f"results of topic {self.topic!r} cannot be read: {self._refused}")

    def _poll(self, timeout_s: float) -> int:
        """Reads what has come, up to `timeout_s`; ConnectionRefusedError once the broker refuses this client."""
        self._raise_if_refused()
        if not self._assign():
            time.sleep(timeout_s)
            return 0
        count = 0
        for record in fetched(self._consumer, timeout_s):
            error = record.error()
            if error is not None:
                self._read_error(record, error)
                continue
            count += 1
            self._next[record.partition()] = record.offset() + 1
            try:
                value = record.value() or b""
                message = decode_answer(value) or decode_message(value, KAFKA_RECORD_BYTES)
            except (DecodeError, ValueError) as exc:  # protobuf's and orjson's errors are ValueErrors
                log.warning("unreadable result at offset %d skipped: %s", record.offset(), exc)
                continue
            self.store.add(message.uri, result_of(message))
        return count

    def _read_error(self, record: Any, error: KafkaError) -> None:
        """An event among the records: a partition's end, or a problem librdkafka retries by itself
        (a group's coordinator still loading, ...) unless it is fatal."""
        if error.code() == KafkaError._PARTITION_EOF:
            self._next[record.partition()] = record.offset()
        elif error.fatal():
            raise KafkaException(error)
        else:
            log.log(logging.DEBUG if error.retriable() else logging.WARNING, "reading %s: %s", self.topic, error.str())

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> OutputQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
