"""Which thread runs a batch, so that no model waits behind another.

One parallel instance of the job hands its Python stage every model's batches on one thread, one
after another. The scheduler gives each model version a lane: a queue and as many threads as its
`instances` (Triton's instance_group count), each running a batch on a copy of the model no other
thread runs meanwhile (ONNX Runtime lets go of Python's lock while it runs). The stage thread
hands a batch to its lane and goes on with the next one; what the lanes finish goes out with a
later call. The JVM batcher makes those calls: an empty poll frame while Python holds batches,
and a drain frame before every checkpoint barrier and at the end of the input, which waits for
them all, so that a checkpoint never covers a request whose result is not written yet.

A batch expected to take under INLINE_US runs at once on the stage thread instead, when its
model's lane is idle (expected: its size times the model's quickest time per request in its last
RECENT_BATCHES, since a batch delayed by a busy core or Python's lock says little of the model): a hand-over between threads costs about 100 microseconds, more
than such a batch (docs/models.md has the figures). The lanes of models on the CPU run at a
lower CPU priority (LANE_NICENESS) than the job's own threads, so that where cores are short, a
model busy on the CPU yields them to Kafka, the batcher and the models served at once, rather
than slowing them all; a GPU model's lane, which mostly waits for the device, keeps the job's. A model whose lane holds `max_queue_size`
requests or more refuses the batches that come meanwhile with `overloaded` error results; with no
bound (0), the stage waits for room, which slows every model of the job instance (backpressure).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

from cluster_serving.runtime.decode import DecodedBatch
from cluster_serving.runtime.frames import DRAIN, POLL
from cluster_serving.runtime.outcomes import Outcome
from cluster_serving.runtime.priority import set_thread_niceness
from cluster_serving.runtime.serve import BatchServer, BatchStats, Routed
from cluster_serving.wire.codec import Message

log = logging.getLogger(__name__)
# A batch expected to take less than this long runs on the stage thread (microseconds).
INLINE_US = 1000
# How many of a model's latest batches its estimate of the next one looks at.
RECENT_BATCHES = 8
# How much lower than the job's threads a lane's thread runs (Linux nice; ONNX Runtime runs a
# session of one thread, model.threads 1, on the calling thread, so its work is included).
LANE_NICENESS = 10
# A flooded model logs its refusals once per this many seconds, with their count and a uri.
REFUSALS_LOGGED_EVERY_S = 1.0


@dataclass
class Done:
    """A batch and its outcomes; `stats` None where no model ran (a route to no open model, a
    refusal, nothing readable)."""

    batch: DecodedBatch
    outcomes: list[Outcome]
    stats: BatchStats | None = None


class Lane:
    """One model version's queue and threads."""

    def __init__(self, server: BatchServer, routed: Routed, finished: queue.SimpleQueue[Done], changed: threading.Condition):
        self.server = server
        self.name = f"{routed.key[0]} version {routed.key[1]}"
        pool = routed.served.pools.get(routed.version)  # a pipeline's steps have pools of their own
        self.threads = pool.size if pool is not None else routed.served.servable.config.instances or 1
        self.lowered = pool is None or pool.first.provider != "CUDAExecutionProvider"  # a GPU model's lane mostly waits
        self.max_queue_size = routed.served.servable.config.max_queue_size
        self.finished = finished
        self.changed = changed  # the scheduler's: guards the counts below, notified when they drop
        self.jobs: queue.SimpleQueue[Routed | None] = queue.SimpleQueue()
        self.waiting_batches = 0
        self.waiting_requests = 0
        self.running = 0
        self.recent_us_per_request: deque[float] = deque(maxlen=RECENT_BATCHES)
        self.refused_unlogged = 0
        self.refusal_logged_at = float("-inf")
        self.workers = [threading.Thread(target=self._work, name=f"lane {self.name} {i}", daemon=True) for i in range(self.threads)]
        for worker in self.workers:
            worker.start()

    @property
    def idle(self) -> bool:
        return self.waiting_batches == 0 and self.running == 0

    def full(self) -> bool:
        """Whether a batch must wait for room before it is queued (no bound): each thread has one waiting."""
        return self.max_queue_size == 0 and self.waiting_batches >= self.threads

    def refuses(self) -> bool:
        return 0 < self.max_queue_size <= self.waiting_requests

    def expected_us(self, size: int) -> float | None:
        """What a batch of `size` requests is expected to take (None: no batch ran yet)."""
        return min(self.recent_us_per_request) * size if self.recent_us_per_request else None

    def runs_at_once(self, size: int) -> bool:
        expected = self.expected_us(size)
        return self.idle and expected is not None and expected < INLINE_US

    def put(self, routed: Routed) -> None:
        """Queues the batch (the caller holds `changed`)."""
        self.waiting_batches += 1
        self.waiting_requests += routed.batch.size
        self.jobs.put(routed)

    def run(self, routed: Routed) -> Done:
        """The batch served here and now; a failure no request caused is every request's error."""
        started = time.perf_counter()
        try:
            outcomes, stats = self.server.run(routed)
        except Exception as exc:
            log.exception("model %s: a batch failed", self.name)
            outcomes, stats = routed.batch.rejected + [
                Message(message.uri, error=f"internal error: {type(exc).__name__}: {exc}", error_code="internal")
                for message in routed.batch.requests()], None
        elapsed_us = (time.perf_counter() - started) * 1_000_000
        with self.changed:
            self.recent_us_per_request.append(elapsed_us / max(routed.batch.size, 1))
        return Done(routed.batch, outcomes, stats)

    def stop(self) -> None:
        for _ in self.workers:
            self.jobs.put(None)

    def _work(self) -> None:
        if self.lowered:
            set_thread_niceness(LANE_NICENESS)
        while (routed := self.jobs.get()) is not None:
            with self.changed:
                self.waiting_batches -= 1
                self.waiting_requests -= routed.batch.size
                self.running += 1
                self.changed.notify_all()
            done = self.run(routed)
            self.finished.put(done)
            with self.changed:
                self.running -= 1
                self.changed.notify_all()


class Scheduler:
    """The batches of one job instance, each on its model's lane (or at once, see the module)."""

    def __init__(self, server: BatchServer):
        self.server = server
        self.lanes: dict[tuple[str, int], Lane] = {}
        self.finished: queue.SimpleQueue[Done] = queue.SimpleQueue()
        self.changed = threading.Condition()
        self.held = 0  # batches handed to lanes and not yet returned by `completed`

    def submit(self, batch: DecodedBatch) -> list[Done]:
        """Takes a batch (or a routing table, which waits for every batch held first; or a poll
        or drain frame's signal); returns the batches done by now, this one among them when it is."""
        if batch.signal == POLL:
            return self.completed()
        if batch.signal == DRAIN:
            return self.drain()
        if batch.table is not None:
            done = self.drain()
            self.server.adopt(batch.table)
            self.close()  # idle: the lanes of the versions served now start with their first batch
            self.lanes.clear()
            return done
        routed, answered = self.server.route(batch)
        if routed is None:
            return [Done(batch, answered), *self.completed()]
        lane = self._lane(routed)
        with self.changed:
            if lane.refuses():
                return [self._refused(routed, lane), *self._completed()]
            if not lane.runs_at_once(routed.batch.size):
                self.changed.wait_for(lambda: not lane.full())
                lane.put(routed)
                self.held += 1
                return self._completed()
        return [lane.run(routed), *self.completed()]

    def completed(self) -> list[Done]:
        """The batches the lanes finished since the last call."""
        with self.changed:
            return self._completed()

    def drain(self) -> list[Done]:
        """Waits for every batch held, and returns all that finished."""
        with self.changed:
            self.changed.wait_for(lambda: all(lane.idle for lane in self.lanes.values()))
            return self._completed()

    def close(self) -> None:
        for lane in self.lanes.values():
            lane.stop()

    def _completed(self) -> list[Done]:
        done = []
        while True:
            try:
                done.append(self.finished.get_nowait())
            except queue.Empty:
                break
        self.held -= len(done)
        return done

    def _lane(self, routed: Routed) -> Lane:
        """The lane of the batch's model version, made with its first batch."""
        lane = self.lanes.get(routed.key)
        if lane is None:
            lane = self.lanes[routed.key] = Lane(self.server, routed, self.finished, self.changed)
        return lane

    def _refused(self, routed: Routed, lane: Lane) -> Done:
        requests = routed.batch.requests()
        reason = (f"model {lane.name} is overloaded: {lane.waiting_requests} requests wait for its "
                  f"{lane.threads} instance(s), max_queue_size is {lane.max_queue_size}; not run, send again later")
        lane.refused_unlogged += len(requests)
        now = time.monotonic()
        if requests and now - lane.refusal_logged_at >= REFUSALS_LOGGED_EVERY_S:
            log.warning("uri=%s %s (%d requests refused since the last such line)", requests[0].uri, reason, lane.refused_unlogged)
            lane.refused_unlogged, lane.refusal_logged_at = 0, now
        name, version = routed.key
        return Done(routed.batch, routed.batch.rejected + [
            Message(message.uri, error=reason, error_code="overloaded", model=name, model_version=version) for message in requests])
