"""The job's Python operators: thin Flink MapFunctions over the runtime's decode, serve and
encode, which count what they do in the Flink UI (`<n>.infer.cluster_serving.batchSize`)."""

from __future__ import annotations

import gc

from pyflink.datastream import MapFunction, RuntimeContext
from pyflink.metrics import Counter

from cluster_serving.config import KafkaConfig, LimitsConfig, ServingConfig
from cluster_serving.runtime.dead_letters import dead_letters
from cluster_serving.runtime.decode import DecodedBatch, decode_frame
from cluster_serving.runtime.encode import batches_frame
from cluster_serving.runtime.scheduler import Done, Scheduler
from cluster_serving.runtime.serve import BatchServer, BatchStats


def add(counter: Counter, count: int) -> None:
    """Counts `count` more; a count of 0, most batches' errors, skips the call into the JVM, which
    PyFlink makes for every inc."""
    if count:
        counter.inc(count)


class DecodeBatch(MapFunction):
    """A frame from the JVM -> its decoded batch, numbered as the JVM numbers request frames;
    decode errors and expired requests counted."""

    def __init__(self, limits: LimitsConfig):
        self.limits = limits
        self.request_frames = 0

    def open(self, runtime_context: RuntimeContext) -> None:
        group = runtime_context.get_metrics_group().add_group("cluster_serving")
        self.records_in = group.counter("requests")
        self.decode_errors = group.counter("decodeErrors")
        self.deadline_exceeded = group.counter("deadlineExceeded")

    def map(self, value: bytes) -> DecodedBatch:
        batch = decode_frame(value, self.limits)
        if batch.table is None and batch.signal is None:
            batch.ordinal, self.request_frames = self.request_frames, self.request_frames + 1
        self.records_in.inc(batch.size)
        add(self.decode_errors, len(batch.rejected) - batch.expired + len(batch.dropped))
        add(self.deadline_exceeded, batch.expired)
        return batch


class ServeBatch(MapFunction):
    """A decoded batch -> the batches done by now (runtime.scheduler: each model's batches on its
    own lane); batch sizes, time in serve, errors and refusals counted for the job and per model
    and version."""

    def __init__(self, config: ServingConfig):
        self.config = config
        self.server: BatchServer | None = None
        self.scheduler: Scheduler | None = None

    def open(self, runtime_context: RuntimeContext) -> None:
        self.server = BatchServer(self.config)
        self.scheduler = Scheduler(self.server)
        self.metrics = runtime_context.get_metrics_group().add_group("cluster_serving")
        self.totals = self._meters(self.metrics)
        self.overloaded = self.metrics.counter("overloaded")
        self.per_version: dict[tuple[str, int], tuple] = {}
        # What is loaded by now (Flink's, Beam's, numpy's and ONNX Runtime's modules, the models)
        # lives as long as the job: frozen, Python's collector no longer walks it in each full
        # collection, which paused every request in flight.
        gc.freeze()

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
        if self.server is not None:
            self.server.close()

    def map(self, value: DecodedBatch) -> list[Done]:
        finished = self.scheduler.submit(value)
        for done in finished:
            if done.stats is not None:
                self._count(done.stats)
            else:
                self.overloaded.inc(sum(1 for outcome in done.outcomes if getattr(outcome, "error_code", None) == "overloaded"))
        return finished

    @staticmethod
    def _meters(group) -> tuple:
        """Batch sizes, times in serve, failed requests and requests served (the model's runs)."""
        return (group.distribution("batchSize"), group.distribution("inferenceTimeUs"), group.counter("inferenceErrors"),
                group.counter("requestsServed"))

    def _count(self, stats: BatchStats) -> None:
        """The job's totals and the same per model and version (Flink UI: ...cluster_serving.model.<name>.version.<v>)."""
        key = stats.model, stats.version
        if key not in self.per_version:
            self.per_version[key] = self._meters(self.metrics.add_group("model", stats.model).add_group("version", str(stats.version)))
        for sizes, times, errors, served in (self.per_version[key], self.totals):
            # In thread mode PyFlink's distribution shows the last value it was given (a gauge): a
            # frame of joined batches updates it once, with their mean; each update is a call into the JVM.
            sizes.update(stats.size // stats.batches)
            times.update(stats.elapsed_us // stats.batches)
            add(errors, stats.failed)
            served.inc(stats.size)


class EncodeResults(MapFunction):
    """The batches done -> one frame of (uri, result bytes) and dead letters, split into Kafka
    records in the JVM, with the numbers of the request frames it answers; dead letters counted."""

    def __init__(self, kafka: KafkaConfig):
        self.kafka = kafka

    def open(self, runtime_context: RuntimeContext) -> None:
        self.dead_letters = runtime_context.get_metrics_group().add_group("cluster_serving").counter("deadLetters")

    def map(self, value: list[Done]) -> bytes:
        batches = []
        for done in value:
            letters = dead_letters(done.batch, done.outcomes, self.kafka)
            add(self.dead_letters, len(letters))
            batches.append((done.outcomes, letters, done.batch.answers))
        return batches_frame(batches, [done.batch.ordinal for done in value if done.batch.ordinal >= 0])
