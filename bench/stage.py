"""`cluster-serving bench stage`: the serving stage alone, beside raw ONNX Runtime on the same batches.

The stage is cluster_serving.runtime's path for a stream of micro-batches, as the job runs it:
frames as the JVM sends them (requests encoded as `InputQueue.enqueue` encodes them), each read
and handed to the scheduler on one thread, served on the model's lane (images decoded, the model
run; with `--model-instances 2`, on two copies at once), and the batches done encoded into results
frames. No Kafka, no Flink, no Java: it runs wherever Python and ONNX Runtime do, a GPU machine
included. From one run it prints, per input kind and batch size: raw ORT on a ready batch, raw ORT
with inputs and outputs bound on the device (CUDA only), the serving stage, and the model's time
inside `session.run` as a share of the stage's. With
`--instances 2,4`, the stage also runs as that many instances at once, in processes (job subtasks
in TaskManagers of one slot) or threads (`--instances-in threads`: subtasks of one TaskManager, in
PyFlink's thread mode), sharing one GPU; their requests/s add up.

    cluster-serving bench stage --model conv224 --inputs tensor,jpeg --batch 32,128
"""

from __future__ import annotations

import argparse
import base64
import importlib
import json
import multiprocessing
from multiprocessing.pool import ThreadPool
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np
import onnxruntime as ort
from bench.images import image_settings, photo_jpeg
from cluster_serving.config import ServingConfig, load_config
from cluster_serving.runtime.frames import (
    Source,
    read_result_frame,
    write_alike_frame,
    write_batch_frame,
    write_control_frame,
    write_headers,
)
from cluster_serving.runtime import rewrites
from cluster_serving.runtime.dead_letters import dead_letters
from cluster_serving.runtime.decode import decode_frame
from cluster_serving.runtime.device_io import GraphRun, graph_run_options
from cluster_serving.runtime.encode import batches_frame
from cluster_serving.runtime.model import open_session
from cluster_serving.runtime.repository import RoutingTable, scan
from cluster_serving.runtime.scheduler import Done, Scheduler
from cluster_serving.runtime.serve import BatchServer
from cluster_serving.wire.codec import decode_message
from cluster_serving.wire.inputs import PROTOCOLS, encode_oip_request, encode_request, protocol_headers
from cluster_serving.wire.open_inference import decode_answer

# Turns of raw ORT and the stage each measurement takes (in_turns).
ROUNDS = 4
# Times requests for about the seconds given: (requests served, seconds taken).
Timer = Callable[[float], tuple[int, float]]
# Built-in models by name: the builder's module and function (imported when used: they need onnx).
BUILDERS = {
    "mlp": ("cluster_serving.ops.sample_model", "build_sample_model"), "cnn": ("bench.models", "build_cnn"),
    "conv224": ("bench.models", "build_conv224"), "resnet50": ("bench.models", "build_resnet50"),
}


@dataclass
class Row:
    model: str
    inputs: str
    batch: int
    device: str
    raw_ort: float
    raw_ort_bound: float | None
    stage: float
    stage_in_run: float  # the share of the stage's time inside session.run
    run_size: int = 0  # rows per session.run, raw and stage alike (0: the batch)
    stage_instances: dict[int, float] | None = None  # instances at once -> their requests/s together
    instances_in: str = "processes"
    model_instances: int = 1  # the copies of the model each stage opened (model.instances, 0 resolved)

    @property
    def ratio(self) -> float:
        return self.stage / (self.raw_ort_bound or self.raw_ort)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="cluster-serving bench stage", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="conv224", help=f"{', '.join(BUILDERS)} or the path of an ONNX model")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--inputs", default="tensor,jpeg", help="request kinds: tensor, jpeg (image models only), or the "
                        "tensor in an Open Inference Protocol encoding: mlserver, oip-json, oip-protobuf")
    parser.add_argument("--batch", default="32", help="batch sizes, comma separated")
    parser.add_argument("--run-size", type=int, default=0, help="rows per session.run, raw and stage alike (0: the batch)")
    parser.add_argument("--model-instances", default="0", help="model.instances, the copies of the model each stage runs "
                        "batches on at once, comma separated: a row each (0: the job's default, 4 on a GPU and 1 on the CPU)")
    parser.add_argument("--instances", default="", help="also run the stage as this many instances at once, comma separated")
    parser.add_argument("--instances-in", choices=["processes", "threads"], default="processes", help="where those instances run")
    parser.add_argument("--float16", action="store_true", help="model.float16: raw ORT and the stage both run the model in float16")
    parser.add_argument("--cuda-graph", action="store_true", help="model.cuda_graph: the stage's full batches and raw ORT with "
                        "I/O bound replay a CUDA graph (CUDA, --run-size 0 only)")
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime's intra-op threads (0: one per core)")
    parser.add_argument("--decode-threads", type=int, default=0, help="model.decode_threads, the image decoders (0: one per core)")
    parser.add_argument("--seconds", type=float, default=3.0, help="timed seconds per measurement")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cuda_graph and (args.device != "cuda" or args.run_size):
        fail("--cuda-graph needs --device cuda and --run-size 0")
    with tempfile.TemporaryDirectory(prefix="stage-bench-") as scratch:
        model = model_file(args.model, Path(scratch))
        rows = [
            row for kind in args.inputs.split(",") for batch in args.batch.split(",")
            for row in measure(model, args.model + ("/fp16" if args.float16 else "") + ("/graph" if args.cuda_graph else ""), kind, int(batch), args)
        ]
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps([asdict(row) | {"ratio": row.ratio} for row in rows], indent=2))
    return 0


def model_file(name: str, folder: Path) -> Path:
    if name in BUILDERS:
        module, function = BUILDERS[name]
        build: Callable[[Path], Path] = getattr(importlib.import_module(module), function)
        return build(folder / f"{name}.onnx")
    path = Path(name)
    if not path.is_file():
        fail(f"--model: {name} is neither a built-in model ({', '.join(BUILDERS)}) nor a file")
    return path


def measure(model: Path, label: str, kind: str, batch: int, args: argparse.Namespace) -> list[Row]:
    """Raw ORT on the batch and the stage on its requests, timed in turns (ROUNDS of each), a row
    per model.instances value."""
    session = open_session(model, args.device, args.threads, float16_bytes(model) if args.float16 else None, args.cuda_graph)
    spec = session.get_inputs()[0]
    shape = tuple(batch if not isinstance(dim, int) else dim for dim in spec.shape)
    samples = np.random.default_rng(0).random(shape, dtype=np.float32)
    runs = [samples[start:start + (args.run_size or batch)] for start in range(0, batch, args.run_size or batch)]
    raw = raw_ort(session, spec.name, runs)
    if args.device != "cuda":
        bound = None
    elif args.cuda_graph:
        bound = raw_ort_replayed(session, spec.name, samples)
    else:
        bound = raw_ort_bound(session, spec.name, runs)
    records, sources = requests(spec.name, kind, samples)
    rows = []
    for instances in _counts(args.model_instances):
        config = stage_config(model, spec.name, kind, shape, batch, instances, args)
        with ServingStage(config, records, sources, batch) as stage:
            rates = in_turns([raw, stage.stream] if bound is None else [raw, bound, stage.stream], args.seconds)
            in_run, copies = stage.in_run.seconds / stage.elapsed, stage.copies
        together = {count: stage_together(config, records, sources, batch, args, count) for count in _counts(args.instances)}
        rows.append(Row(label, kind, batch, args.device, rates[0], rates[1] if bound else None, rates[-1], in_run, args.run_size,
                        together or None, args.instances_in, copies))
    return rows


def in_turns(timers: list[Timer], seconds: float) -> list[float]:
    """Requests/s of each timer, timed for `seconds` in all, ROUNDS turns of each one after the
    other: a machine whose speed drifts over seconds (a shared host's does) then slows or speeds
    them alike, which one after the other it would not."""
    done, elapsed = [0] * len(timers), [0.0] * len(timers)
    for _ in range(ROUNDS):
        for index, timer in enumerate(timers):
            requests, took = timer(seconds / ROUNDS)
            done[index] += requests
            elapsed[index] += took
    return [count / took for count, took in zip(done, elapsed)]


def float16_bytes(model: Path) -> bytes:
    """The model as model.float16 runs it, for raw ORT alike."""
    return rewrites.float16(rewrites.load(model)).SerializeToString()


def raw_ort(session: ort.InferenceSession, name: str, runs: list[np.ndarray]) -> Timer:
    """session.run on ready batches, one run per item of `runs` (outside any CUDA graph)."""
    options = graph_run_options(-1)
    return _calls(lambda: [session.run(None, {name: rows}, options) for rows in runs], sum(map(len, runs)))


def raw_ort_bound(session: ort.InferenceSession, name: str, runs: list[np.ndarray]) -> Timer:
    """Runs with inputs copied to the device once and outputs left there (I/O binding)."""
    bindings = []
    for rows in runs:
        binding = session.io_binding()
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(rows, "cuda", 0))
        for output in session.get_outputs():
            binding.bind_output(output.name, "cuda", 0)
        bindings.append(binding)
    options = graph_run_options(-1)
    return _calls(lambda: [session.run_with_iobinding(binding, options) for binding in bindings], sum(map(len, runs)))


def raw_ort_replayed(session: ort.InferenceSession, name: str, batch: np.ndarray) -> Timer:
    """A CUDA graph's replays, its inputs copied to the device once and outputs left there."""
    graph = GraphRun(session, {name: batch}, [output.name for output in session.get_outputs()], "cuda")
    return _calls(lambda: session.run_with_iobinding(graph.binding, graph.options), len(batch))


def stage_config(model: Path, name: str, kind: str, shape: tuple[int, ...], batch: int, instances: int,
                 args: argparse.Namespace) -> ServingConfig:
    overrides = {
        "model.path": str(model), "model.threads": args.threads, "model.decode_threads": args.decode_threads,
        "model.instances": instances,
        "model.float16": args.float16, "model.cuda_graph": args.cuda_graph, "device": args.device,
        "batching.batch_size": batch, "batching.run_batch_size": args.run_size, "limits.max_instance_bytes": 64 << 20,
    }
    if kind == "jpeg":
        channels_first = shape[1] == 3
        height, width = shape[2:4] if channels_first else shape[1:3]
        overrides["preprocess.images"] = {name: {**image_settings(height, width), "layout": "CHW" if channels_first else "HWC"}}
    return load_config(overrides=overrides)


def requests(name: str, kind: str, samples: np.ndarray) -> tuple[list[tuple[str, bytes]], list[Source]]:
    """(uri, request bytes) per instance, as InputQueue.enqueue writes them, and the records'
    headers: the tensor, a JPEG of it (its pixels, smooth enough to compress as photos do), or
    the tensor as a batch of one in an OIP encoding (with that protocol's headers)."""
    if kind in PROTOCOLS and kind != "native":
        headers = Source(headers=write_headers(protocol_headers(kind, [])))
        return [(f"r{i}", encode_oip_request(kind, f"r{i}", {name: row[np.newaxis]})) for i, row in enumerate(samples)], [headers] * len(samples)
    if kind == "tensor":
        return [(f"r{i}", encode_request(f"r{i}", {name: row})) for i, row in enumerate(samples)], []
    if kind != "jpeg" or samples.ndim != 4 or 3 not in (samples.shape[1], samples.shape[3]):
        fail(f"--inputs: {kind} requests need an image model (3 channels); this one takes {samples.shape[1:]}")
    return [(f"r{i}", encode_request(f"r{i}", {name: {"b64": base64.b64encode(photo_jpeg(row)).decode()}})) for i, row in enumerate(samples)], []


class ServingStage:
    """The job's serving path over a stream of the batch's frame. As in the job, this thread reads
    each frame and hands it to the scheduler, the model runs on its lane (or at once, where quick),
    and the batches done are encoded into results frames. Every result of a first frame is checked
    to be one; `in_run` adds up the model's time inside session.run over the streams."""

    def __init__(self, config: ServingConfig, records: list[tuple[str, bytes]], sources: list[Source], batch: int):
        self.config, self.batch = config, batch
        self.server = BatchServer(config)
        self.scheduler = Scheduler(self.server)
        self.scheduler.submit(decode_frame(write_control_frame(RoutingTable.of(scan(config)).text()), config.limits))
        served, version = self.server.servables.resolve("", "")
        self.frame = (None if sources else write_alike_frame("", "", records)) or write_batch_frame("", "", records, sources or None)
        results = [decode_answer(bytes(payload)) or decode_message(bytes(payload), 64 << 20)
                   for _, payload in read_result_frame(self._encoded(self._submit() + self.scheduler.drain()))]
        errors = [result.error for result in results if result.error]
        if len(results) != batch or errors:
            self.close()
            fail(f"the stage answered {len(results)} results for {batch} requests, {len(errors)} errors {errors[:1]}")
        self.copies = served.pools[version].size
        self.in_run = _RunTime()
        for model in served.pools[version].copies:
            for method in ("run", "run_with_iobinding"):  # the host path runs, the device path runs bound
                setattr(model.session, method, self.in_run.timed(getattr(model.session, method)))
        self.elapsed = 0.0

    def __enter__(self) -> ServingStage:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self.scheduler.close()
        self.server.close()

    def stream(self, seconds: float) -> tuple[int, float]:
        """(requests served, seconds taken): frames submitted for `seconds`, then every batch
        held finished, after a warm-up of three; each batch done encoded as the job encodes it."""
        for _ in range(3):
            self._encoded(self._submit())
        self._encoded(self.scheduler.drain())
        self.in_run.counting = True
        done, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds or done < 3:
            finished = self._submit()
            self._encoded(finished)
            done += len(finished)
        finished = self.scheduler.drain()
        self._encoded(finished)
        elapsed = time.perf_counter() - started
        self.in_run.counting = False
        self.elapsed += elapsed
        return (done + len(finished)) * self.batch, elapsed

    def _submit(self) -> list[Done]:
        return self.scheduler.submit(decode_frame(self.frame, self.config.limits))

    def _encoded(self, done: list[Done]) -> bytes:
        """The results frame of the batches done, as the job's EncodeResults writes it."""
        return batches_frame([(item.outcomes, dead_letters(item.batch, item.outcomes, self.config.kafka), item.batch.answers)
                              for item in done])


def serving_stage(config: ServingConfig, records: list[tuple[str, bytes]], sources: list[Source], batch: int,
                  seconds: float) -> float:
    """Requests/s of one ServingStage's stream of `seconds` (a process or thread of stage_together)."""
    with ServingStage(config, records, sources, batch) as stage:
        served, elapsed = stage.stream(seconds)
    return served / elapsed


class _RunTime:
    """Seconds spent inside the sessions' runs, from any thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.seconds = 0.0
        self.counting = False  # True while a stream is timed

    def timed(self, call: Callable[..., object]) -> Callable[..., object]:
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                with self.lock:
                    self.seconds += (time.perf_counter() - started) if self.counting else 0.0

        return timed


def stage_together(config: ServingConfig, records: list[tuple[str, bytes]], sources: list[Source], batch: int,
                   args: argparse.Namespace, count: int) -> float:
    """Requests/s of `count` stages, each with its own models, serving the same batches at once
    (in processes or threads, as args.instances_in says), added up."""
    pool = multiprocessing.get_context("spawn").Pool(count) if args.instances_in == "processes" else ThreadPool(count)
    with pool:
        return sum(pool.starmap(serving_stage, [(config, records, sources, batch, args.seconds)] * count))


def _counts(text: str) -> list[int]:
    return [int(count) for count in text.split(",") if count]


def _calls(call: Callable[[], object], requests: int) -> Timer:
    """A Timer of `call` (serving `requests` each time), after a warm-up of three calls."""
    for _ in range(3):
        call()

    def timer(seconds: float) -> tuple[int, float]:
        count, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds or count < 3:
            call()
            count += 1
        return count * requests, elapsed

    return timer


def fail(message: str) -> NoReturn:
    """A mistake in the options, or a stage that does not serve: one line, exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def print_table(rows: list[Row]) -> None:
    print(f"{'model':<10} {'inputs':<7} {'batch':>5} {'run':>4} {'device':<6} {'raw ORT':>10} {'raw bound':>10} "
          f"{'copies':>6} {'stage':>10} {'in run':>7} {'stage/raw':>9}")
    for row in rows:
        bound = f"{row.raw_ort_bound:10,.0f}" if row.raw_ort_bound else f"{'-':>10}"
        print(f"{row.model:<10} {row.inputs:<7} {row.batch:>5} {row.run_size or row.batch:>4} {row.device:<6} "
              f"{row.raw_ort:10,.0f} {bound} {row.model_instances:>6} {row.stage:10,.0f} {row.stage_in_run:7.0%} {row.ratio:9.3f}")
    print("req/s; run: rows per session.run; copies: model.instances; 'in run': the model's time inside session.run as a share "
          "of the stage's (over 100% where copies run at once); stage/raw: against raw ORT with I/O bound where measured, "
          "else plain raw ORT, same batch, run size and threads")
    for row in rows:
        if row.stage_instances:
            shown = ", ".join(f"{count}: {rate:,.0f}" for count, rate in row.stage_instances.items())
            print(f"{row.model} {row.inputs} batch {row.batch} copies {row.model_instances}, stages at once in {row.instances_in} (req/s together): "
                  f"1: {row.stage:,.0f}, {shown}")


if __name__ == "__main__":
    sys.exit(main())
