"""End-to-end benchmark: the serving job against raw ONNX Runtime and a plain consumer loop.

Two models, one run, one table (and with --json, the same figures as JSON):

    cluster-serving bench [--models mlp,cnn] [--batch-size 32] [--http-clients 1,8,32] [--json PATH]

For each model (bench/models.py: the sample classifier, 64-byte requests; a small CNN, 48 KiB
requests), all measured in this run on this machine:
1. raw ONNX Runtime: a plain session (same model and device choice as the job's) fed ready
   batches of 1, of the job's run size and of --batch-size: the ceiling of what serving can reach.
   The job runs a batch in runs of the model's run_batch_size (batching.run_batch_size; for the
   CNN 1, at which this CPU runs it fastest per request; --run-batch-size for all). Measured three times
   beside the model's own phases (before its job starts, after the job's capacity drain, after its
   HTTP phases; the broker and the job idle), the mean the ceiling: this machine's speed drifts
   (the CNN's raw ORT at batch 32: 1,138 to 1,329 req/s within one run, 1,191 to 1,519 over two
   days), and a ceiling taken minutes away from the drain it divides was as much that drift as the
   job;
2. plain consumer loop (bench/baseline.py): what a user would write instead of the job, run alone
   on the same backlog, timed the same way as the job, with the job's run size; the librdkafka
   loop's capacity is the median of PLAIN_LOOP_DRAINS drains, the rest written in one transaction
   each while it runs, as the running job's are; last, once the
   job has stopped, the librdkafka loop paced at the job's rate as the job was, from its start and
   warm (plain_loop_paced);
3. the job: it starts on that backlog and drains it, timed by the broker's append stamps of its
   results (so the client's own decoding speed is not in the figure; from the one past a warm-up
   share of the backlog to the last): its capacity right after start (and the seconds from the
   start call until every result of the backlog was read); then capacity = the rate
   at which the running job drains backlogs as large, the median of the last SETTLED_DRAINS of
   RUNNING_DRAINS, each written in one transaction while it serves (see running_drain), and its
   serving stage alone over it, from the time each result says its batch took; then latency
   (send -> result read) of requests paced at half that capacity, at most LATENCY_MAX_RATE (or
   --rate), for --latency-seconds, after 30 s at that rate untimed;
   the paced sender and the reader are librdkafka clients (bench/kafka_load.py), which leave the
   cores to the job, and the job's share is told apart by the broker's append times; after the
   HTTP phases, the job restarted in its JVM as `cluster-serving restart` does it: its capacity
   right after (restart_drain), then, restarted again, paced from its start for
   --first-minute-seconds, and last a new JVM's job (a stop, then a start) paced so too;
4. HTTP: for each of --http-clients, that many clients each sending one-instance POST /predict
   requests over a kept-alive connection to the bridge for --http-seconds, after 2 s untimed:
   throughput and latency as they see them;
5. client: how fast one thread puts the backlog on the topic, its first half with
   InputQueue.enqueue (+ one flush), the rest with enqueue_batch, and how fast
   OutputQueue.dequeue from one thread hands over the job's results, against the job's capacity;
6. two models: a repository serving the mlp twice, as models `a` and `b`, each with a servable.yaml
   of --batch-size and --max-delay-ms; a backlog alternating a, b, a, b ... drained by the job as in
   3 (--multi-model-requests, 0: left out): capacity, and per model the mean size of the batches
   that served it (from the batch_size every result carries) against that batch_size, beside the
   mlp's own drain right after start in this run (this drain too begins as its job starts). The
   job batches each model apart, so its batches stay full; a batcher that cut a batch wherever the
   model changes would serve this backlog one at a time.
Ratios: job capacity / raw ORT at --batch-size and at the job's run size (the serving path's own
cost), job capacity / plain loop, HTTP at the most clients
/ raw ORT at --batch-size, two models / the mlp alone. In the JSON, rates are requests per second
and latencies milliseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import yaml

from bench.baseline import CLIENTS as PLAIN_LOOP_CLIENTS
from bench.baseline import READY_LINE as PLAIN_LOOP_READY
from bench.http_load import http_load, http_protocol, predict_requests
from bench.kafka_load import Arrival, ResultReader, paced_sender, raw_requests
from bench.models import BenchModel, bench_models
from bench.report import batch_stats, group_cpu_seconds, json_safe, latency_ms, machine, plural, table, with_ratios
from cluster_serving.client.queues import InputQueue, OutputQueue
from cluster_serving.config import ConfigError, ServingConfig, defaults, load_config
from cluster_serving.config.command_line import OneLineParser
from cluster_serving.kafka.admin import end_offsets, ensure_topics, topic_records
from cluster_serving.kafka.librdkafka import paced
from cluster_serving.ops.children import ChildProcess, EmbeddedJob, HttpBridge, LocalBroker
from cluster_serving.ops.processes import free_port, write_run_config
from cluster_serving.runtime.model import open_session
from cluster_serving.wire.tensors import ONNX_DTYPES

# Distinct instances per model; requests cycle through them (a CNN backlog would otherwise be
# 100 MB of client memory).
SAMPLES = 64
# Each HTTP phase: this long at its client count untimed, then --http-seconds timed. Phases of 20
# requests per client took under a second with 32 clients on the CNN: their p99 was 6 requests, and
# the step from the phase before was in it.
HTTP_WARMUP_S = 2.0
HTTP_SECONDS = 5.0
# The paced phase runs at this share of the measured capacity: loaded, not saturated.
LATENCY_LOAD = 0.5
# The most the paced phases ask without --rate: past it one sender process, beside the job and the
# broker on two cores, no longer keeps its rate, and the latency is the machine's (docs/benchmarks.md).
LATENCY_MAX_RATE = 40_000.0
# The paced phase's length, after LATENCY_WARMUP_S at its rate untimed. The job's JVM is young when
# the phase starts (a minute or two old, its JIT compilers still busy): with 1 s untimed the job's
# share of the latency was p99 126 ms at 27,785 req/s; with 10 s, p99 18 ms at 31,000 req/s. Its
# C2 compiler still installed 11 methods a second in the 20 s after that: one minute paced at
# 50,000/s after 10 s untimed, p99 per 10 s: 44, 23, 22, 25, 22 and 24 ms. Hence 30 s.
LATENCY_SECONDS = 10.0
LATENCY_WARMUP_S = 30.0
LATENCY_MIN_REQUESTS = 100
# Backlogs written while the job runs, drained one after another; the median of the last
# SETTLED_DRAINS is its capacity: the JIT goes on making the job faster over the first five or six
# (docs/benchmarks.md).
RUNNING_DRAINS = 8
SETTLED_DRAINS = 3
# The plain librdkafka loop's capacity: the median of its drains of the backlog, the first
# written before it starts, the rest while it runs (plain_loop_rates).
PLAIN_LOOP_DRAINS = 3
# A running drain is timed only when it takes at least this long: a shorter one is a few bursts of
# results (docs/benchmarks.md).
SHORTEST_TIMED_DRAIN_S = 0.25
# The restarted job's paced phase: its latency in windows of this length.
FIRST_MINUTE_S = 60.0
FIRST_MINUTE_WINDOW_S = 10.0
DRAIN_TIMEOUT_S = 900.0
DEFAULT_HIDDEN = 256
# The two-model drain: the models of its repository (both the mlp) and its default backlog, half the
# mlp's: about 2 s of drain at the job's mlp capacity on the 2-core development machine.
MULTI_MODELS = ("a", "b")
MULTI_MODEL_SOURCE = "mlp"
MULTI_MODEL_REQUESTS = 100_000
# The bench's topics stamp each record when the broker appends it, so the paced phase can tell the
# job's share of a request's latency from the clients'.
BROKER_TIMESTAMPS = {"message.timestamp.type": "LogAppendTime"}


class PlainLoop(ChildProcess):
    """bench/baseline.py in a process of its own, as a user's loop would run: it does not share
    the benchmark's interpreter (and GIL) with the reader that times it."""

    module = "bench.baseline"
    ready_pattern = re.compile(re.escape(PLAIN_LOOP_READY))

    def __init__(self, config_path: Path, input_topic: str, result_topic: str, client: str, log_path: Path):
        super().__init__(["--config", str(config_path), "--input-topic", input_topic, "--result-topic", result_topic,
                          "--client", client], log_path)


def progress(model: str, text: str) -> None:
    """One line per phase as it starts: a full run takes minutes."""
    print(f"[bench] {model}: {text}", file=sys.stderr, flush=True)


def enqueue_all(config: ServingConfig, uris: list[str], name: str, samples: np.ndarray, rate: float = 0.0,
                sent: dict[str, float] | None = None, models: tuple[str, ...] = ()) -> None:
    """Sends one request per uri (input `name`, cycling through `samples`) with InputQueue.enqueue,
    at `rate` per second or as fast as it goes (0), and one flush at the end; `sent` gets each
    uri's send time; with `models`, request i names models[i % len(models)] (none: the default)."""
    with InputQueue(config.kafka.bootstrap_servers, config.kafka.input_topic) as inputs:
        for i in paced(len(uris), rate):
            if sent is not None:
                sent[uris[i]] = time.perf_counter()
            inputs.enqueue(uris[i], model=models[i % len(models)] if models else None, **{name: samples[i % len(samples)]})
        inputs.flush()


def dequeue_rate(config: ServingConfig, count: int) -> float:
    """Results per second that OutputQueue.dequeue hands over, from one thread, reading `count`
    results already on the result topic under a group of its own: whether a client keeps up."""
    kafka = config.kafka
    with OutputQueue(kafka.bootstrap_servers, kafka.result_topic, group_id=f"{kafka.group_id}-bench-dequeue") as outputs:
        started, taken = time.perf_counter(), 0
        while taken < count and time.perf_counter() - started < DRAIN_TIMEOUT_S:
            taken += len(outputs.dequeue())
        return taken / (time.perf_counter() - started)


def ready_batch(session: ort.InferenceSession, batch_size: int) -> dict[str, np.ndarray]:
    """Random feeds of `batch_size` instances for every input of the session (fixed instance shapes)."""
    rng = np.random.default_rng(1)
    return {
        node.name: rng.normal(size=(batch_size, *node.shape[1:])).astype(ONNX_DTYPES[node.type])
        for node in session.get_inputs()
    }


def raw_rates(session: ort.InferenceSession, sizes: list[int]) -> dict[str, float]:
    """Raw ONNX Runtime at each batch size, keyed by the size as JSON writes it."""
    return {str(size): raw_onnxruntime(session, size) for size in sizes}


def ceiling(measured: list[dict[str, float]]) -> dict[str, Any]:
    """The mean of the raw ORT measurements per batch size, and each size's (lowest, highest)."""
    return {"raw_ort": {size: float(np.mean([m[size] for m in measured])) for size in measured[0]},
            "raw_ort_range": {size: (min(m[size] for m in measured), max(m[size] for m in measured))
                              for size in measured[0]}}


def raw_onnxruntime(session: ort.InferenceSession, batch_size: int, seconds: float = 2.0) -> float:
    """Requests per second of a plain InferenceSession fed ready batches (no Kafka, no Flink),
    run for `seconds`: a fixed number of runs of a small model lasts milliseconds and is noise."""
    feeds = ready_batch(session, batch_size)
    warm_until = time.perf_counter() + seconds / 10  # first runs are slower (allocation, caches)
    while time.perf_counter() < warm_until:
        session.run(None, feeds)
    runs, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        session.run(None, feeds)
        runs += 1
    return runs * batch_size / elapsed


def timed_drain(reader: ResultReader, server: ChildProcess, start: int, end: int) -> tuple[float, float]:
    """(drain rate, seconds from the start call until the reader had every result): starts
    `server` while `reader` already watches its result topic: start() returns once the server is
    ready, and a fast one can drain much of the backlog by then. The caller stops it."""
    called = time.perf_counter()
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(server.start)
        drained = reader.wait_for(end, lambda: not starting.done() or server.running, DRAIN_TIMEOUT_S)
        answered = time.perf_counter() - called
        starting.result()  # a server that did not start raises here, with its log
    if not drained:
        raise no_results(server, end)
    return reader.drain_rate(start, end), answered


def no_results(server: ChildProcess, end: int) -> RuntimeError:
    return RuntimeError(f"{server.module} did not write {end} results:\n{server.log_tail()}")


def wait_for_results(reader: ResultReader, server: ChildProcess, end: int) -> None:
    """Returns once the reader's topic holds `end` results; raises, with the server's log, should
    the server stop first or DRAIN_TIMEOUT_S pass."""
    if not reader.wait_for(end, lambda: server.running, DRAIN_TIMEOUT_S):
        raise no_results(server, end)


def running_drain(config: ServingConfig, reader: ResultReader, job: EmbeddedJob, model: BenchModel,
                  samples: np.ndarray, uris: list[str], protocol: str = "native") -> tuple[float, bool, float]:
    """(capacity, a lower bound only, microseconds of the job's CPU per request): the running
    job's drain rate, and the CPU its processes (Python and the Flink JVM, all their threads) used
    from the first write of the backlog to its last result. The backlog goes on the input topic
    through enqueue_batch in one Kafka transaction while the job serves: the job, reading
    committed requests only, meets all of it at once when it commits, however slow the writer,
    and is timed from the first of its results to the last. Should the drain take less than
    SHORTEST_TIMED_DRAIN_S, it is too short to time: the figure is then the whole backlog over the
    time from its first write to its last result, a lower bound set by the writer."""
    progress(model.name, f"a backlog of {len(uris)} requests{'' if protocol == 'native' else ' in ' + protocol},"
                         " written in one transaction while the job runs ...")
    before, started, cpu = reader.written(), time.perf_counter(), group_cpu_seconds(job.process.pid)
    enqueue_batch_all(config, uris, model.input_name, samples, protocol, transactional_id=f"cs-bench-{model.name}")
    end = before + len(uris)
    wait_for_results(reader, job, end)
    whole = len(uris) / (time.perf_counter() - started)
    cpu_us = (group_cpu_seconds(job.process.pid) - cpu) / len(uris) * 1e6
    rate = reader.drain_rate(before, end)
    reader.read_until(uris, timeout=300)
    timed = not math.isnan(rate) and len(uris) / rate >= SHORTEST_TIMED_DRAIN_S
    return (rate, False, cpu_us) if timed else (whole, True, cpu_us)


def plain_loop_rates(config: ServingConfig, model: BenchModel, samples: np.ndarray | list, uris: list[str],
                     warmup: int, folder: Path) -> dict[str, list[float]]:
    """Drain rates of each plain loop (PLAIN_LOOP_CLIENTS) over the same backlog as raw bytes, as a
    user's producer writes them, on a topic of its own with the job's partitions; each loop runs
    alone and writes to a result topic of its own, so that it has the cores to itself as the job
    will. The librdkafka loop then drains PLAIN_LOOP_DRAINS - 1 backlogs as large more, each
    written in one transaction while it runs, as the running job's are (loop_running_drain)."""
    kafka = config.kafka
    raw_topic = f"{kafka.input_topic}-raw"
    ensure_topics(kafka.model_copy(update={"input_topic": raw_topic}))
    progress(model.name, f"the same backlog as raw bytes on {raw_topic} for the plain loops ...")
    enqueue_raw(kafka.bootstrap_servers, raw_topic, uris, samples)
    rates = {}
    for client in PLAIN_LOOP_CLIENTS:
        progress(model.name, f"plain consumer loop on {client} (bench/baseline.py) draining it ...")
        result_topic = f"{kafka.result_topic}-plain-{client}"
        ensure_topics(kafka.model_copy(update={"result_topic": result_topic}), topic_configs=BROKER_TIMESTAMPS)
        loop = PlainLoop(config.source, raw_topic, result_topic, client, folder / f"plain-{client}-{model.name}.log")
        reader = ResultReader(kafka.bootstrap_servers, result_topic)
        try:
            rates[client] = [timed_drain(reader, loop, warmup, len(uris))[0]]
            for drain in range(1, PLAIN_LOOP_DRAINS if client == PLAIN_LOOP_CLIENTS[0] else 1):
                backlog = [f"{client}-{drain}-{i}" for i in range(len(uris) - warmup)]
                rates[client].append(loop_running_drain(kafka.bootstrap_servers, raw_topic, reader, loop, samples, backlog))
        finally:
            loop.stop()
            reader.close()
    return rates


def plain_loop_capacities(drains: dict[str, list[float]]) -> dict[str, float]:
    """Each plain loop's capacity: the median of its drains (plain_loop_rates)."""
    return {client: statistics.median(rates) for client, rates in drains.items()}


def loop_running_drain(bootstrap: str, topic: str, reader: ResultReader, loop: PlainLoop,
                       samples: np.ndarray | list, uris: list[str]) -> float:
    """The running plain loop's drain rate over a backlog written as raw bytes in one transaction:
    the loop, reading committed records only, meets all of it at once."""
    progress("plain loop", f"a backlog of {len(uris)} raw requests, written in one transaction while it runs ...")
    before = reader.written()
    enqueue_raw(bootstrap, topic, uris, samples, transactional_id=f"cs-bench-{topic}")
    end = before + len(uris)
    wait_for_results(reader, loop, end)
    return reader.drain_rate(before, end)


def enqueue_raw(bootstrap: str, topic: str, uris: list[str], samples: np.ndarray | list,
                transactional_id: str | None = None) -> None:
    """One record per uri, its value the raw bytes of a sample (a tensor's, or a JPEG's), as the
    paced sender writes the plain loop's requests; with a `transactional_id`, in one transaction."""
    send, flush = raw_requests(bootstrap, topic, DRAIN_TIMEOUT_S, transactional_id)
    for i, uri in enumerate(uris):
        send(uri, samples[i % len(samples)])
    flush()


def fill_backlog(config: ServingConfig, model: BenchModel, samples: np.ndarray, uris: list[str],
                 models: tuple[str, ...] = (), label: str = "") -> dict[str, dict[str, Any]]:
    """Puts the backlog on the input topic before anything serves; the time it takes gives the
    client's figures, each from one thread with one flush: InputQueue.enqueue, one call per
    request, for the first half, and enqueue_batch for the rest. With `models` (the repository's
    models the requests name in turn, see enqueue_all) all go through enqueue."""
    half = len(uris) if models else len(uris) // 2
    progress(label or model.name, f"filling a backlog of {len(uris)} requests (InputQueue.enqueue"
                                  f"{'' if models else ', then enqueue_batch'}) ...")
    figures = {"enqueue": client_rate("InputQueue.enqueue, one thread, one flush", model, half, lambda: (
        enqueue_all(config, uris[:half], model.input_name, samples, models=models)))}
    if half < len(uris):
        figures["enqueue_batch"] = client_rate("InputQueue.enqueue_batch, one thread", model, len(uris) - half, lambda: (
            enqueue_batch_all(config, uris[half:], model.input_name, samples)))
    return figures


def client_rate(method: str, model: BenchModel, count: int, send: Callable[[], None]) -> dict[str, Any]:
    """Requests per second and MB/s of tensor payload of `send`, which sends `count` requests."""
    started = time.perf_counter()
    send()
    rate = count / (time.perf_counter() - started)
    return {"method": method, "rate": rate, "mb_per_s": rate * model.instance_bytes / 1e6}


def enqueue_batch_all(config: ServingConfig, uris: list[str], name: str, samples: np.ndarray,
                      protocol: str = "native", transactional_id: str | None = None,
                      before_commit: Callable[[], None] = lambda: None) -> None:
    """One request per uri (input `name`, cycling through `samples`) through one enqueue_batch
    call, in `protocol` (InputQueue's; in the OIP ones each a batch of one); with a
    `transactional_id`, all in one Kafka transaction, committed once `before_commit` returns."""
    batch = (lambda sample: sample) if protocol == "native" else (lambda sample: sample[np.newaxis])
    kafka = {"transactional_id": transactional_id} if transactional_id else {}
    with InputQueue(config.kafka.bootstrap_servers, config.kafka.input_topic, protocol=protocol, **kafka) as inputs, \
            inputs.transaction() if transactional_id else contextlib.nullcontext():
        inputs.enqueue_batch((uri, {name: batch(samples[i % len(samples)])}) for i, uri in enumerate(uris))
        before_commit()


def paced_uris(rate: float, seconds: float) -> tuple[list[str], list[str]]:
    """(LATENCY_WARMUP_S untimed, `seconds` timed) of requests at `rate`."""
    timed = max(LATENCY_MIN_REQUESTS, round(rate * seconds))
    return [f"paced-warmup-{i}" for i in range(round(rate * LATENCY_WARMUP_S))], [f"paced-{i}" for i in range(timed)]


def paced_latency(config: ServingConfig, reader: ResultReader, model: BenchModel, samples: np.ndarray,
                  rate: float, warmup: list[str], uris: list[str], window_s: float = 0.0, raw: bool = False,
                  server: ChildProcess | None = None) -> dict[str, Any]:
    """Send -> result read of requests sent at `rate` to the running job (`warmup` first, untimed),
    with `window_s` also per window of that many seconds (the warm-up's among them), and the job's
    share of it: the request's append to the input topic -> its result's append to
    the result topic, both stamped by the broker, so the sender's and the reader's time (clients
    on the same cores) are not in it. With `raw`, the requests are the plain loop's (raw bytes on
    config's input topic; `reader` a raw one) and the share is the loop's. The sender is a process of
    its own: beside the reader's thread, under one GIL, it sent 2,400 of 20,000 req/s asked. The
    CPU per request of the sender, and with `server` (the job's or the loop's process) its own,
    paced: on cores shared by the clients, the broker and the server, what one leaves the others
    sets how long requests wait."""
    progress(model.name, f"paced latency: {len(uris)} requests at {rate:,.0f} req/s "
                         f"(after {len(warmup)} untimed), librdkafka clients ...")
    kafka = config.kafka
    since = end_offsets(kafka.bootstrap_servers, kafka.input_topic)
    context = multiprocessing.get_context("spawn")
    stamps = context.Queue()
    requests = warmup + uris
    sender = context.Process(target=paced_sender, args=(
        kafka.bootstrap_servers, kafka.input_topic, requests, model.input_name, samples, rate, stamps, raw))
    pending = reader.pending(requests)
    cpu = group_cpu_seconds(server.process.pid) if server else math.nan
    sender.start()
    reader.read_pending(pending, timeout=300 + len(requests) / rate)
    cpu_us = (group_cpu_seconds(server.process.pid) - cpu) / len(requests) * 1e6 if server else math.nan
    times, failed, sender_cpu = stamps.get(timeout=60)
    sender.join()
    sent = dict(zip(requests, times.tolist()))
    if failed:
        raise RuntimeError(f"the paced sender could not deliver {len(failed)} requests: {failed[0]}")
    # One client process may not keep up with half a high capacity: say what it really sent.
    sent_rate = (len(uris) - 1) / (sent[uris[-1]] - sent[uris[0]])
    latencies = [(reader.arrivals[uri].seconds - sent[uri]) * 1000 for uri in uris if uri in reader.arrivals]
    # When the broker appended each request (LogAppendTime, ms), by uri; control records have none.
    appended = {record.key.decode(): record.timestamp
                for record in topic_records(kafka.bootstrap_servers, kafka.input_topic, since=since) if record.key}
    in_job = [reader.arrivals[uri].appended_ms - appended[uri] for uri in uris if uri in reader.arrivals and uri in appended]
    # The windows cover the untimed warm-up too: how long the job takes to settle at this load.
    step = max(1, round(rate * window_s))
    windows = [requests[start:start + step] for start in range(0, len(requests), step)] if window_s else []
    return {"rate": rate, "sent_rate": sent_rate, "requests": len(uris), "warmup": len(warmup), "cpu_us_per_request": cpu_us,
            "sender_cpu_us_per_request": sender_cpu / len(requests) * 1e6,
            "windows": [{**latency_ms([(reader.arrivals[uri].seconds - sent[uri]) * 1000 for uri in window if uri in reader.arrivals]),
                         "job_share": latency_ms([reader.arrivals[uri].appended_ms - appended[uri] for uri in window
                                                  if uri in reader.arrivals and uri in appended])} for window in windows],
            **latency_ms(latencies), "job_share": latency_ms(in_job),
            **({} if raw else {"batches": batch_stats([reader.arrivals[uri].batch_size or 0 for uri in uris if uri in reader.arrivals],
                                                      config.batching.batch_size)})}


def restart_drain(config: ServingConfig, reader: ResultReader, job: EmbeddedJob, model: BenchModel,
                  samples: np.ndarray, uris: list[str]) -> float:
    """The drain right after `cluster-serving restart` (a final savepoint, then the job again in
    its JVM): the backlog goes on the input topic in one transaction, committed once every task of
    the restarted job runs, so that the new job meets all of it as it starts; timed like the drain
    right after start, from the result past the first tenth to the last."""
    progress(model.name, f"a backlog of {len(uris)} requests, committed once the job restarted in its JVM runs ...")
    before = reader.written()
    enqueue_batch_all(config, uris, model.input_name, samples, transactional_id=f"cs-bench-restart-{model.name}",
                      before_commit=job.restart)
    end = before + len(uris)
    wait_for_results(reader, job, end)
    reader.read_until(uris, timeout=300)
    return reader.drain_rate(before + len(uris) // 10, end)


def first_minute(config: ServingConfig, model: BenchModel, samples: np.ndarray, rate: float, args: argparse.Namespace,
                 how: str, start: Callable[[], object]) -> dict[str, Any]:
    """The job started again by `start` (resuming from the last job's final savepoint) and paced at
    `rate` from the moment its tasks run, for --first-minute-seconds: latency per FIRST_MINUTE_WINDOW_S,
    what users see of JIT compilation, class loading and the first checkpoints after a restart, and
    how long `start` took to have every task running."""
    uris = [f"{how}-{i}" for i in range(round(rate * args.first_minute_seconds))]
    progress(model.name, f"the job started again ({how}), paced at {rate:,.0f} req/s from its start for "
                         f"{args.first_minute_seconds:g} s ...")
    reader = ResultReader(config.kafka.bootstrap_servers, config.kafka.result_topic, from_end=True)
    try:
        called = time.perf_counter()
        start()
        seconds = time.perf_counter() - called
        figures = paced_latency(config, reader, model, samples, rate, [], uris, FIRST_MINUTE_WINDOW_S)
        return {**figures, "start_seconds": seconds, "missing": sum(uri not in reader.arrivals for uri in uris)}
    finally:
        reader.close()


def plain_loop_paced(config: ServingConfig, model: BenchModel, samples: np.ndarray, rate: float,
                     args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """The plain librdkafka loop (bench/baseline.py) paced as the job is, at the job's `rate` and
    alone on the cores, its requests raw bytes on a topic of their own: started anew and paced from
    the moment it is ready for --first-minute-seconds, latency per FIRST_MINUTE_WINDOW_S (what a
    user sees of a loop they restart: its consumer group's join among it), then, warm, for
    --latency-seconds (after LATENCY_WARMUP_S untimed when there was no first minute)."""
    kafka = config.kafka
    paced = config.model_copy(update={"kafka": kafka.model_copy(update={
        "input_topic": f"{kafka.input_topic}-raw-paced", "result_topic": f"{kafka.result_topic}-plain-paced"})})
    ensure_topics(paced.kafka, topic_configs=BROKER_TIMESTAMPS)
    client = PLAIN_LOOP_CLIENTS[0]
    reader = ResultReader(kafka.bootstrap_servers, paced.kafka.result_topic, from_end=True, raw=True)
    loop = PlainLoop(config.source, paced.kafka.input_topic, paced.kafka.result_topic, client,
                     folder / f"plain-paced-{client}-{model.name}.log")
    figures: dict[str, Any] = {"first_minute": None}
    try:
        called = time.perf_counter()
        loop.start()
        ready = time.perf_counter() - called
        if args.first_minute_seconds:
            progress(model.name, f"plain loop on {client} started anew, paced at {rate:,.0f} req/s from its start for "
                                 f"{args.first_minute_seconds:g} s ...")
            uris = [f"plain-first-{i}" for i in range(round(rate * args.first_minute_seconds))]
            first = paced_latency(paced, reader, model, samples, rate, [], uris, FIRST_MINUTE_WINDOW_S, raw=True)
            figures["first_minute"] = {**first, "start_seconds": ready, "missing": sum(uri not in reader.arrivals for uri in uris)}
        warmup, uris = paced_uris(rate, args.latency_seconds)
        warmup = [] if args.first_minute_seconds else warmup
        figures["warm"] = paced_latency(paced, reader, model, samples, rate, warmup, uris, raw=True, server=loop)
        figures["warm"]["missing"] = sum(uri not in reader.arrivals for uri in warmup + uris)
    finally:
        loop.stop()
        reader.close()
    return figures


def run_config(folder: Path, model_path: Path, bootstrap: str, args: argparse.Namespace, run_batch_size: int = 0,
               **sections: Any) -> ServingConfig:
    """A config of its own for one job of the run, with the run's batching, parallelism, device
    and threads (plus `sections`); written to a file for the job, returned loaded, topics created."""
    path = write_run_config(
        folder, model_path, bootstrap,
        batching={"batch_size": args.batch_size, "max_delay_ms": args.max_delay_ms, "run_batch_size": run_batch_size},
        flink={"parallelism": args.parallelism, "jvm_options": args.jvm_options, "warm_up_requests": args.warm_up_requests,
               "jit_after_warm_up": args.jit_after_warm_up, "checkpoint_interval_ms": args.checkpoint_interval_ms},
        device=args.device, model={"threads": args.threads},
        kafka={"partitions": args.partitions}, **sections,
    )
    config = load_config(path)
    ensure_topics(config.kafka, topic_configs=BROKER_TIMESTAMPS)
    return config


def backlog_uris(prefix: str, count: int, args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(warm-up uris, timed backlog uris): --warmup, or a tenth of the backlog, go first."""
    backlog = [f"{prefix}backlog-{i}" for i in range(count)]
    warmup = [f"{prefix}warmup-{i}" for i in range(count // 10 if args.warmup is None else args.warmup)]
    return warmup, backlog


def measure_serving(model: BenchModel, model_path: Path, bootstrap: str, folder: Path,
                    args: argparse.Namespace) -> dict[str, Any]:
    """Phases 2 to 5 for one model against the broker at `bootstrap`; the job starts only once the
    plain loop has stopped, so neither shares the cores with the other."""
    run_size = model.run_batch_size if args.run_batch_size is None else args.run_batch_size
    images = {"preprocess": {"images": model.images}} if model.images else {}
    config = run_config(folder, model_path, bootstrap, args, run_size, **images)
    config_path = config.source
    samples = model.samples(SAMPLES)
    warmup, backlog = backlog_uris("", args.requests or model.requests, args)
    client_figures = fill_backlog(config, model, samples, warmup + backlog)
    plain_drains = plain_loop_rates(config, model, samples, warmup + backlog, len(warmup), folder)

    session = open_session(model_path, args.device, args.threads)  # the job's provider choice and threads
    runs_of = min(run_size or args.batch_size, args.batch_size)  # what a run of the job holds at most
    raw_sizes = sorted({1, runs_of, args.batch_size})
    progress(model.name, f"raw ONNX Runtime at batch {', '.join(map(str, raw_sizes))} (1 of 3) ...")
    raw = [raw_rates(session, raw_sizes)]
    progress(model.name, "starting the job; it drains the backlog as soon as it runs ...")
    reader = ResultReader(bootstrap, config.kafka.result_topic)
    job = EmbeddedJob(config_path, config.flink.rest_port, folder / f"job-{model.name}.log")
    try:
        capacity_at_start, start_to_answered = timed_drain(reader, job, len(warmup), len(warmup) + len(backlog))
        reader.read_until(warmup + backlog, timeout=300)
        progress(model.name, "OutputQueue.dequeue reading the results ...")
        dequeued = dequeue_rate(config, len(warmup) + len(backlog))
        # The first drain of a backlog written while the job runs comes 20-30 s into its JVM's life,
        # while C2 still compiles.
        drains = []
        for drain in range(RUNNING_DRAINS):
            running = [f"running-{drain}-{i}" for i in range(len(backlog))]
            drains.append((running, *running_drain(config, reader, job, model, samples, running)))
        running, capacity, writer_bound, cpu_us = sorted(drains[-SETTLED_DRAINS:], key=lambda drain: drain[1])[
            SETTLED_DRAINS // 2]
        # The same backlog in the peers' encodings (the client's protocol=, one instance a request);
        # tensors only: an image request is no OIP tensor.
        protocols = [] if model.images else args.protocols
        protocol_drains = {protocol: ([f"{protocol}-{i}" for i in range(len(backlog))],) for protocol in protocols}
        for protocol, (uris,) in protocol_drains.items():
            protocol_drains[protocol] = (uris, *running_drain(config, reader, job, model, samples, uris, protocol))
        progress(model.name, "raw ONNX Runtime (2 of 3) ...")
        raw.append(raw_rates(session, raw_sizes))
        rate = args.rate or min(LATENCY_LOAD * capacity, LATENCY_MAX_RATE)
        paced_warmup, paced = paced_uris(rate, args.latency_seconds)
        latency = paced_latency(config, reader, model, samples, rate, paced_warmup, paced, FIRST_MINUTE_WINDOW_S, server=job)
        served = http_phases(model, config_path, folder, samples, args)
        progress(model.name, "raw ONNX Runtime (3 of 3) ...")
        raw.append(raw_rates(session, raw_sizes))
        after_restart = [f"after-restart-{i}" for i in range(len(backlog))]
        capacity_after_restart = restart_drain(config, reader, job, model, samples, after_restart)
        restarted = first_minute(config, model, samples, rate, args, "restarted", job.restart) if args.first_minute_seconds else None
    finally:
        job.stop()
        reader.close()
    new_jvm = EmbeddedJob(config_path, config.flink.rest_port, folder / f"job-new-jvm-{model.name}.log")
    try:
        started_again = first_minute(config, model, samples, rate, args, "new-jvm", new_jvm.start) if args.first_minute_seconds else None
    finally:
        new_jvm.stop()
    loop_paced = plain_loop_paced(config, model, samples, rate, args, folder)
    arrivals = reader.arrivals
    sizes = [arrivals[uri].batch_size or 0 for uri in running if uri in arrivals]
    return {
        "provider": session.get_providers()[0],
        "run_batch_size": runs_of,
        **ceiling(raw),
        "serving_stage": serving_stage_rate([arrivals[uri] for uri in running if uri in arrivals]),
        "requests": len(backlog),
        "warmup": len(warmup),
        **client_figures,
        "dequeue": dequeued,
        "plain_loop": plain_loop_capacities(plain_drains),
        "plain_loop_drains": plain_drains,
        "capacity": capacity,
        "capacity_bound_by_writer": writer_bound,
        "running_drains": [{"capacity": rate, "bound_by_writer": bound, "job_cpu_us_per_request": cpu}
                           for _, rate, bound, cpu in drains],
        "settled_drains": SETTLED_DRAINS,
        "protocol_drains": {protocol: {"capacity": rate, "bound_by_writer": bound, "job_cpu_us_per_request": cpu}
                            for protocol, (_, rate, bound, cpu) in protocol_drains.items()},
        "capacity_at_start": capacity_at_start,
        "start_to_backlog_answered_seconds": start_to_answered,
        "capacity_after_restart": capacity_after_restart,
        "job_cpu_us_per_request": cpu_us,
        "mean_batch": float(np.mean(sizes)) if sizes else 0.0,
        "batches": batch_stats(sizes, args.batch_size),
        "latency": latency,
        "first_minute_restarted": restarted,
        "first_minute_new_jvm": started_again,
        "plain_loop_paced": loop_paced,
        "http": served,
        "missing": sum(uri not in arrivals for uri in warmup + backlog + paced_warmup + paced)
        + sum(uri not in arrivals for uris, *_ in drains for uri in uris)
        + sum(uri not in arrivals for uris, *_ in protocol_drains.values() for uri in uris)
        + sum(uri not in arrivals for uri in after_restart)
        + sum(figures["missing"] for figures in (restarted, started_again) if figures),
        "errors": sum(arrival.error for arrival in arrivals.values()),
    }


def serving_stage_rate(arrivals: list[Arrival]) -> float:
    """Requests per second of the job's serving stage alone (ONNX Runtime with its pre- and
    postprocessing) while it drained the backlog, from the time each result says its batch took:
    beside raw ORT, it tells how much of the job's gap to raw ORT is the model running slower in
    the job, and how much the rest of the serving path."""
    timed = [a.inference_us / a.batch_size for a in arrivals if a.inference_us and a.batch_size]
    return len(timed) / (sum(timed) / 1e6) if timed else float("nan")


def http_phases(model: BenchModel, config_path: Path, folder: Path, samples: np.ndarray,
                args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The bridge at each client count for --http-seconds, after HTTP_WARMUP_S at that count untimed."""
    bodies = predict_requests(model, samples)
    progress(model.name, "starting the HTTP bridge ...")
    served: dict[str, dict[str, Any]] = {}
    with HttpBridge(config_path, folder / f"bridge-{model.name}.log") as bridge:
        for clients in args.http_clients:
            progress(model.name, f"HTTP {http_protocol(model)}: {plural(clients, 'client')}, "
                                 f"{args.http_seconds:g} s after {HTTP_WARMUP_S:g} s untimed ...")
            served[f"{clients} untimed"] = http_load(bridge.url, bodies, clients, HTTP_WARMUP_S)  # its failures count
            served[str(clients)] = http_load(bridge.url, bodies, clients, args.http_seconds)
    return served


def two_model_repository(folder: Path, model_path: Path, args: argparse.Namespace) -> Path:
    """MULTI_MODELS, each version 1 of `model_path` with a servable.yaml of the run's batching."""
    for name in MULTI_MODELS:
        (folder / name / "1").mkdir(parents=True)
        shutil.copyfile(model_path, folder / name / "1" / "model.onnx")
        batching = {"batch_size": args.batch_size, "max_delay_ms": args.max_delay_ms}
        (folder / name / "servable.yaml").write_text(yaml.safe_dump({"batching": batching}))
    return folder


def measure_two_models(model: BenchModel, model_path: Path, bootstrap: str, folder: Path,
                       args: argparse.Namespace) -> dict[str, Any]:
    """Phase 6: the job serving `model` twice from a repository (MULTI_MODELS) drains a backlog of
    requests naming them in turn, timed as in measure_serving; then every result is read back for
    the size of the batch that served it and the model that did."""
    label = f"{len(MULTI_MODELS)} models"
    repository = two_model_repository(folder / "repository", model_path, args)
    config = run_config(folder, model_path, bootstrap, args,
                        models={"repository": str(repository), "default": MULTI_MODELS[0]})
    config_path = config.source
    samples = model.samples(SAMPLES)
    warmup, backlog = backlog_uris("multi-", args.multi_model_requests, args)
    uris = warmup + backlog
    asked = {uri: MULTI_MODELS[i % len(MULTI_MODELS)] for i, uri in enumerate(uris)}
    client_figures = fill_backlog(config, model, samples, uris, MULTI_MODELS, label)
    progress(label, f"starting the job on a repository of {', '.join(MULTI_MODELS)}; it drains the backlog ...")
    reader = ResultReader(bootstrap, config.kafka.result_topic)
    job = EmbeddedJob(config_path, config.flink.rest_port, folder / "job-multi-model.log")
    try:
        capacity, _ = timed_drain(reader, job, len(warmup), len(uris))
        reader.read_until(uris, timeout=300)
    finally:
        job.stop()
        reader.close()
    arrivals = reader.arrivals
    served = {
        name: batch_stats([arrivals[uri].batch_size or 0 for uri in backlog if uri in arrivals and asked[uri] == name],
                          args.batch_size)
        for name in MULTI_MODELS
    }
    return {
        "description": f"the {model.name} twice, as models {', '.join(MULTI_MODELS)} of one repository, each with "
                       f"a servable.yaml of batch_size {args.batch_size}; requests alternating "
                       f"{', '.join(MULTI_MODELS)}, {', '.join(MULTI_MODELS)} ...",
        "source_model": model.name,
        "requests": len(backlog),
        "warmup": len(warmup),
        **client_figures,
        "capacity": capacity,
        "models": served,
        "missing": sum(uri not in arrivals for uri in uris),
        "errors": sum(arrival.error for arrival in arrivals.values()),
        # Served by the other model than the request named (a result names its model).
        "misrouted": sum(uri in arrivals and arrivals[uri].model != asked[uri] for uri in uris),
    }


def client_counts(text: str) -> list[int]:
    counts = sorted({int(part) for part in text.split(",") if part.strip()})
    if not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError("a comma-separated list of client counts >= 1, e.g. 1,8,32")
    return counts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    models = bench_models(hidden=DEFAULT_HIDDEN)  # names and per-model defaults only: --hidden is parsed below
    parser = OneLineParser(prog="cluster-serving bench", description=__doc__.splitlines()[0])
    backlogs = ", ".join(f"{m.name} {m.requests}" for m in models.values())
    parser.add_argument("--models", default=",".join(models), help="comma-separated, from: " + ", ".join(models))
    parser.add_argument("--requests", type=int, help=f"size of the backlog drained for capacity (default: {backlogs})")
    parser.add_argument("--warmup", type=int, help="requests before the timed backlog (default: a tenth of it; they "
                                                    "absorb the start and the JIT's first minute)")
    parser.add_argument("--latency-seconds", type=float, default=LATENCY_SECONDS,
                        help=f"length of the paced phase, after {LATENCY_WARMUP_S:g} s at its rate untimed")
    parser.add_argument("--first-minute-seconds", type=float, default=FIRST_MINUTE_S,
                        help="length of the paced phase of the job started again, timed from its start "
                             f"(latency per {FIRST_MINUTE_WINDOW_S:g} s; 0: none)")
    parser.add_argument("--rate", type=float, help="requests per second of the paced phase "
                                                   f"(default: half the capacity measured in this run, at most {LATENCY_MAX_RATE:,.0f})")
    parser.add_argument("--http-clients", type=client_counts, default=[1, 8, 32], help="client counts, e.g. 1,8,32")
    parser.add_argument("--http-seconds", type=float, default=HTTP_SECONDS,
                        help=f"length of each HTTP phase, after {HTTP_WARMUP_S:g} s at its client count untimed")
    parser.add_argument("--multi-model-requests", type=int,
                        help=f"backlog of the two-model drain, requests alternating {', '.join(MULTI_MODELS)} "
                             f"(default: --requests, else {MULTI_MODEL_REQUESTS}; 0: no two-model drain)")
    job = defaults()
    parser.add_argument("--protocols", type=lambda text: [p for p in text.split(",") if p], default=["mlserver", "oip-protobuf"],
                        help="after the running drains, drain the same backlog written in these OIP encodings "
                        "(InputQueue's protocol=: mlserver, oip-json, oip-protobuf; '' for none)")
    parser.add_argument("--batch-size", type=int, default=job.batching.batch_size)
    parser.add_argument("--max-delay-ms", type=int, default=job.batching.max_delay_ms)
    parser.add_argument("--parallelism", type=int, default=job.flink.parallelism)
    parser.add_argument("--partitions", type=int, default=job.kafka.partitions,
                        help="partitions of the input topics (the job's and the plain loops')")
    parser.add_argument("--jvm-options", type=lambda text: text.split(), default=list(job.flink.jvm_options),
                        help="the job's flink.jvm_options, space-separated: --jvm-options=-XX:TieredStopAtLevel=1")
    parser.add_argument("--warm-up-requests", type=int, default=job.flink.warm_up_requests,
                        help="the job's flink.warm_up_requests: served before it serves, in each new JVM")
    parser.add_argument("--jit-after-warm-up", choices=["c1", "c2"], default=job.flink.jit_after_warm_up,
                        help="the job's flink.jit_after_warm_up: what the JIT compiles after the warm-up")
    parser.add_argument("--checkpoint-interval-ms", type=int,
                        help="the job's flink.checkpoint_interval_ms (default: the config's, by kafka.delivery)")
    parser.add_argument("--hidden", type=int, default=DEFAULT_HIDDEN, help="hidden width of the mlp")
    parser.add_argument("--device", default=job.device, choices=["auto", "cpu", "cuda"])
    parser.add_argument("--run-batch-size", type=int,
                        help="ONNX Runtime's run size within a batch (batching.run_batch_size) for the job and the "
                             "plain loop, 0: the whole batch (default: per model, " + ", ".join(
                                 f"{m.name} {m.run_batch_size}" for m in models.values()) + ")")
    parser.add_argument("--threads", type=int, default=job.model.threads,
                        help="ONNX Runtime's intra-op threads (model.threads) for the job, the plain loop and raw ORT")
    parser.add_argument("--bootstrap", help="a running Kafka to use instead of a local broker")
    parser.add_argument("--json", type=Path, help="also write the figures to this file as JSON")
    args = parser.parse_args(argv)
    args.models = [name.strip() for name in args.models.split(",") if name.strip()]
    unknown = sorted(set(args.models) - set(models))
    if unknown or not args.models:
        parser.error(f"--models: unknown {unknown}; choose from {', '.join(models)}")
    if args.requests is not None and args.requests < 1000:
        parser.error("--requests: at least 1000, or the drain is too short to time")
    if args.latency_seconds <= 0:
        parser.error("--latency-seconds: more than 0")
    if args.http_seconds <= 0:
        parser.error("--http-seconds: more than 0")
    if args.multi_model_requests is None:
        args.multi_model_requests = args.requests or MULTI_MODEL_REQUESTS
    elif 0 < args.multi_model_requests < 1000:
        parser.error("--multi-model-requests: at least 1000, or 0 for no two-model drain")
    return args


def run(args: argparse.Namespace, models: dict[str, BenchModel], folder: Path) -> dict[str, Any]:
    """Serving phases for every model on one broker (raw ONNX Runtime among them), and the
    two-model drain."""
    paths = {name: models[name].build(folder / f"{name}.onnx") for name in args.models}
    source = models[MULTI_MODEL_SOURCE]
    source_path = paths.get(source.name) or source.build(folder / f"{source.name}.onnx")
    broker = None if args.bootstrap else LocalBroker(folder / "kafka", port=free_port(), log_path=folder / "broker.log")
    if broker:
        progress("broker", "starting the local Kafka broker ...")
        broker.start()
    try:
        bootstrap = args.bootstrap or broker.bootstrap_servers
        figures = {name: measure_serving(models[name], paths[name], bootstrap, folder, args) for name in args.models}
        multi = (measure_two_models(source, source_path, bootstrap, folder, args)
                 if args.multi_model_requests else None)
    finally:
        if broker:
            broker.stop()
    results = {}
    for name in args.models:
        model = models[name]
        results[name] = {"description": model.description, "instance_bytes": model.instance_bytes,
                         "http_protocol": http_protocol(model), **with_ratios(figures[name], args)}
    if multi is not None:
        alone = figures.get(source.name)
        # Both drains begin as their job starts: like against like.
        multi["single_model"] = alone and {"capacity": alone["capacity_at_start"],
                                           "mean_batch": alone["batches"]["mean_batch"]}
        multi["capacity_over_single_model"] = multi["capacity"] / alone["capacity_at_start"] if alone else float("nan")
    providers = sorted({figures[name]["provider"] for name in args.models})
    return {"machine": machine(", ".join(providers)), "models": results, "multi_model": multi}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    models = bench_models(hidden=args.hidden)
    try:
        with tempfile.TemporaryDirectory(prefix="cs-bench-") as name:
            report = run(args, models, Path(name))
    # ConfigError: e.g. --bootstrap where no broker answers; RuntimeError: a child that did not
    # start or stopped serving, with its log.
    except (ConfigError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report["settings"] = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    failures = sum(m["missing"] + sum(h["failures"] for h in m["http"].values()) for m in report["models"].values())
    if report["multi_model"]:
        failures += report["multi_model"]["missing"] + report["multi_model"]["misrouted"]
    report["ok"] = failures == 0
    print(table(report, args))
    if args.json:
        args.json.write_text(json.dumps(json_safe(report), indent=1) + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
