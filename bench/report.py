"""The benchmark's report: latency percentiles, ratios, the machine it ran on, and the one table."""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench.baseline import CLIENTS as PLAIN_LOOP_CLIENTS
from cluster_serving.ops.processes import process_group_members


def latency_ms(values: list[float]) -> dict[str, float]:
    """p50, p95 and p99 of latencies in milliseconds (NaN without values)."""
    points = np.percentile(values, [50, 95, 99]) if values else [float("nan")] * 3
    return {"p50_ms": float(points[0]), "p95_ms": float(points[1]), "p99_ms": float(points[2])}


def percentiles(values: list[float]) -> str:
    q = latency_ms(values)
    return f"p50 {q['p50_ms']:.1f} ms, p95 {q['p95_ms']:.1f} ms, p99 {q['p99_ms']:.1f} ms"


def machine(provider: str) -> dict[str, Any]:
    """What the figures were measured on: they mean little without it."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    return {"nproc": len(os.sched_getaffinity(0)), "cpu": cpu[1] if cpu else "unknown",
            "provider": provider, "gpu": gpu_name() if provider == "CUDAExecutionProvider" else None}


def gpu_name() -> str | None:
    """The GPU's name from nvidia-smi (onnxruntime does not tell); None without it."""
    if not shutil.which("nvidia-smi"):
        return None
    answer = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                            capture_output=True, text=True, check=False)
    return answer.stdout.strip().splitlines()[0] if answer.returncode == 0 and answer.stdout.strip() else None


def group_cpu_seconds(group: int) -> float:
    """CPU seconds (user and system) used so far by the live processes of a process group: the
    embedded job's Python and its Flink JVM."""
    seconds = 0.0
    for pid in process_group_members(group):
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        seconds += times.user + times.system
    return seconds


def batch_stats(sizes: list[int], batch_size: int) -> dict[str, Any]:
    """The batches that served some requests, from the batch_size each one's result carries: a
    batch of s requests is s results saying s, so there were sum(1/s) batches, and requests /
    batches is their mean size (each batch counted once, not once per request: a few batches of 1
    among full ones show). `full_share`: the share of the requests served in a batch of
    `batch_size`, the configured one. Results without a batch size (errors) are left out."""
    known = [size for size in sizes if size]
    batches = sum(1 / size for size in known)
    return {"batch_size": batch_size, "requests": len(known), "batches": round(batches),
            "mean_batch": len(known) / batches if batches else float("nan"),
            "full_share": sum(size >= batch_size for size in known) / len(known) if known else float("nan")}


def with_ratios(figures: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    most = str(args.http_clients[-1])
    ceiling = figures["raw_ort"][str(args.batch_size)]
    at_run_size = figures["raw_ort"][str(figures["run_batch_size"])]
    return {**figures, "ratios": {
        "capacity_over_raw_ort": figures["capacity"] / ceiling,
        "capacity_over_raw_ort_at_run_size": figures["capacity"] / at_run_size,
        # Whether the model runs slower inside the job: against raw ORT at the size the job runs.
        "serving_stage_over_raw_ort_at_run_size": figures["serving_stage"] / at_run_size,
        # Against the loop a user would write today: on librdkafka, in raw bytes.
        "capacity_over_plain_loop": figures["capacity"] / figures["plain_loop"]["librdkafka"],
        "capacity_at_start_over_plain_loop": figures["capacity_at_start"] / figures["plain_loop"]["librdkafka"],
        "capacity_after_restart_over_plain_loop": figures["capacity_after_restart"] / figures["plain_loop"]["librdkafka"],
        f"http_{most}_clients_over_raw_ort": figures["http"][most]["rate"] / ceiling,
    }}


def first_minute_rows(title: str, key: str, started: str = "until every task ran",
                      share: str = "the job's share") -> list[tuple[str, Callable[[dict[str, Any]], str]]]:
    """How long a start took, the p99 of the paced phase after it as a whole and of each of its 10 s:
    as read, and the server's share (`key` is a path of keys, dot-separated)."""
    def figures(m: dict[str, Any]) -> dict[str, Any] | None:
        for part in key.split("."):
            m = m[part] if m else None
        return m

    def shown(field: str, spec: str) -> Callable[[dict[str, Any]], str]:
        return lambda m: format(figures(m)[field], spec) if figures(m) else "-"

    return [(f"{title}: {started} (s)", shown("start_seconds", ".1f")),
            ("  then paced: p99 of the whole phase (ms)", shown("p99_ms", ".0f")),
            ("  then paced: p99 per 10 s (ms)", lambda m: window_p99s(figures(m), False)),
            (f"  {share}", lambda m: window_p99s(figures(m), True))]


def window_p99s(paced: dict[str, Any] | None, share: bool) -> str:
    """The p99 of each window of a paced phase (ms), as read or (`share`) the server's share."""
    if not paced:
        return "-"
    return ", ".join(f"{(window['job_share'] if share else window)['p99_ms']:.0f}" for window in paced["windows"])


def table(report: dict[str, Any], args: argparse.Namespace) -> str:
    """The machine and settings in one line, then one row per figure and one column per model."""
    box = report["machine"]
    gpu = f", {box['gpu']}" if box["gpu"] else ""
    head = (f"machine: {box['nproc']} cores (nproc), {box['cpu']}, {box['provider']}{gpu} (device {args.device}); "
            f"batch_size {args.batch_size}, max_delay_ms {args.max_delay_ms}, parallelism {args.parallelism}"
            + (f", JVM {' '.join(args.jvm_options)}" if args.jvm_options else "")
            + (f", warm-up of {args.warm_up_requests:,} requests" if args.warm_up_requests else ""))
    rows = [("", list(report["models"])), *table_rows(list(report["models"].values()), args)]
    widths = [max(len(cells[i]) for _, cells in rows) for i in range(len(report["models"]))]
    # The two-model drain is one figure, not one per model: its rows span the columns.
    spanning = multi_model_rows(report["multi_model"]) if report.get("multi_model") else []
    label_width = max(len(label) for label, _ in [*rows, *spanning])
    lines = ["  ".join([label.ljust(label_width), *(cell.ljust(w) for cell, w in zip(cells, widths))]).rstrip()
             for label, cells in rows]
    lines += [f"{label.ljust(label_width)}  {text}" for label, text in spanning]
    return "\n".join([head, *lines])


def multi_model_rows(multi: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, text) for the two-model drain: capacity beside the source model's own drain, then
    per model the mean size of the batches that served it against its batch_size."""
    names, alone, source = list(multi["models"]), multi["single_model"], multi["source_model"]
    stats = list(multi["models"].values())

    def each(cell: Callable[[dict[str, Any]], str]) -> str:
        return " / ".join(cell(s) for s in stats)

    def share(value: float) -> str:
        return "n/a" if math.isnan(value) else f"{value:.0%}"

    compared = (f"; {multi['capacity_over_single_model']:#.3g} of the {source} alone right after start "
                f"({alone['capacity']:,.0f})"
                if alone else f"; the {source} alone: not run (--models)")
    alone_batch = f"; the {source} alone {alone['mean_batch']:.1f}" if alone else ""
    return [
        (f"{len(names)} models interleaved, job (req/s)",
         f"{multi['capacity']:,.0f} (backlog {multi['requests']:,} alternating {', '.join(names)}: "
         f"the {source} twice){compared}"),
        (f"{len(names)} models, mean batch {' / '.join(names)}",
         f"{each(lambda s: format(s['mean_batch'], '.1f'))} of batch_size {each(lambda s: str(s['batch_size']))} "
         f"({each(lambda s: format(s['batches'], ','))} batches, {each(lambda s: share(s['full_share']))} of "
         f"requests in full ones){alone_batch}"),
        (f"{len(names)} models, missing / error / misrouted",
         f"{multi['missing']} / {multi['errors']} / {multi['misrouted']}"),
    ]


def protocol_drain(model: dict[str, Any], protocol: str) -> str:
    """The running drain of the backlog in an OIP encoding; "-" for a model sent none (images)."""
    drain = model["protocol_drains"].get(protocol)
    if drain is None:
        return "-"
    return (f"{'at least ' if drain['bound_by_writer'] else ''}{drain['capacity']:,.0f} ({drain['capacity'] / model['capacity']:#.3g}"
            f" x ours), CPU {drain['job_cpu_us_per_request']:.1f} us per request")


def table_rows(models: list[dict[str, Any]], args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(label, one cell per model) for every figure of the report, ratios last."""
    b, most = args.batch_size, args.http_clients[-1]

    def row(label: str, cell: Callable[[dict[str, Any]], str]) -> tuple[str, list[str]]:
        return label, [cell(m) for m in models]

    def timing(t: dict[str, Any]) -> str:
        return f"p50 {t['p50_ms']:.0f}, p95 {t['p95_ms']:.0f}, p99 {t['p99_ms']:.0f} ms"

    return [
        row("model", lambda m: m["description"]),
        row("request tensor", lambda m: f"{m['instance_bytes']:,} B"),
        row("raw ORT, batch 1 (req/s)", lambda m: f"{m['raw_ort']['1']:,.0f}"),
        row(f"raw ORT, batch {b} (req/s)", lambda m: (
            f"{m['raw_ort'][str(b)]:,.0f} (mean of 3: {m['raw_ort_range'][str(b)][0]:,.0f}-{m['raw_ort_range'][str(b)][1]:,.0f})")),
        row("ONNX Runtime run size in a batch", lambda m: (
            f"{m['run_batch_size']}" + ("" if m["run_batch_size"] == b else
                                       f" (raw ORT at {m['run_batch_size']}: {m['raw_ort'][str(m['run_batch_size'])]:,.0f} req/s)"))),
        *(row(f"plain loop on {client}, raw bytes (req/s)", lambda m, client=client: loop_drains(m, client))
          for client in PLAIN_LOOP_CLIENTS),
        row("job capacity, running (req/s)", lambda m: (
            f"{'at least ' if m['capacity_bound_by_writer'] else ''}{m['capacity']:,.0f} (backlog {m['requests']:,}; "
            f"median of the last {m['settled_drains']} of its drains: {all_drains(m)})")),
        row("  right after start, a new JVM (req/s)", lambda m: (
            f"{m['capacity_at_start']:,.0f} (start -> every result read: {m['start_to_backlog_answered_seconds']:.1f} s)")),
        row("  right after a restart in its JVM (req/s)", lambda m: f"{m['capacity_after_restart']:,.0f}"),
        *(row(f"  the backlog in {protocol}, running (req/s)", lambda m, protocol=protocol: protocol_drain(m, protocol))
          for protocol in args.protocols),
        row("  job CPU per request, running (us)", lambda m: f"{m['job_cpu_us_per_request']:.1f}"),
        row("job mean batch", lambda m: f"{m['mean_batch']:.1f}"),
        row("  its serving stage alone (req/s)", lambda m: (
            f"{m['serving_stage']:,.0f} ({m['ratios']['serving_stage_over_raw_ort_at_run_size']:#.3g} of raw ORT "
            f"at batch {m['run_batch_size']})")),
        row("job latency, paced (send -> result read)", lambda m: (
            f"{m['latency']['rate']:,.0f}/s asked, {m['latency']['sent_rate']:,.0f} sent: {timing(m['latency'])}, "
            f"mean batch {m['latency']['batches']['mean_batch']:.1f}; CPU per request: job {m['latency']['cpu_us_per_request']:.1f} us, "
            f"its sender (InputQueue.enqueue) {m['latency']['sender_cpu_us_per_request']:.1f}")),
        row("  the job's share (input append -> result append)", lambda m: timing(m["latency"]["job_share"])),
        row("  p99 per 10 s, untimed warm-up included (ms)", lambda m: window_p99s(m["latency"], False)),
        row("  the job's share", lambda m: window_p99s(m["latency"], True)),
        *(row(*pair) for pair in first_minute_rows("job restarted in its JVM (cluster-serving restart)", "first_minute_restarted")),
        *(row(*pair) for pair in first_minute_rows("job started in a new JVM (stop, then start)", "first_minute_new_jvm")),
        row(f"plain loop on {PLAIN_LOOP_CLIENTS[0]}, paced alike, warm", lambda m: (
            f"{m['plain_loop_paced']['warm']['sent_rate']:,.0f}/s sent: {timing(m['plain_loop_paced']['warm'])}; its share p99 "
            f"{m['plain_loop_paced']['warm']['job_share']['p99_ms']:.0f} ms; CPU per request: loop "
            f"{m['plain_loop_paced']['warm']['cpu_us_per_request']:.1f} us, its sender (raw bytes) "
            f"{m['plain_loop_paced']['warm']['sender_cpu_us_per_request']:.1f}")),
        *(row(*pair) for pair in first_minute_rows(f"plain loop on {PLAIN_LOOP_CLIENTS[0]} started anew",
                                                   "plain_loop_paced.first_minute", "until ready", "its share")),
        row("HTTP requests", lambda m: m["http_protocol"]),
        *(row(f"HTTP, {plural(clients, 'client')}", lambda m, key=str(clients): (
            f"{m['http'][key]['rate']:,.0f} req/s: {timing(m['http'][key])}")) for clients in args.http_clients),
        *(row(f"client InputQueue.{method}, 1 thread", lambda m, method=method: (
            f"{m[method]['rate']:,.0f} req/s, {m[method]['mb_per_s']:.1f} MB/s")) for method in ("enqueue", "enqueue_batch")),
        row("client OutputQueue.dequeue, 1 thread", lambda m: (
            f"{m['dequeue']:,.0f} results/s ({m['dequeue'] / m['capacity']:#.3g} x job capacity)")),
        row(f"ratio job / raw ORT batch {b}", lambda m: f"{m['ratios']['capacity_over_raw_ort']:#.3g}"),
        row("ratio job / raw ORT at its run size", lambda m: f"{m['ratios']['capacity_over_raw_ort_at_run_size']:#.3g}"),
        row("ratio job / plain loop on librdkafka, running", lambda m: f"{m['ratios']['capacity_over_plain_loop']:#.3g}"),
        row("  right after start, a new JVM", lambda m: f"{m['ratios']['capacity_at_start_over_plain_loop']:#.3g}"),
        row("  right after a restart in its JVM", lambda m: f"{m['ratios']['capacity_after_restart_over_plain_loop']:#.3g}"),
        row(f"ratio HTTP {plural(most, 'client')} / raw ORT batch {b}",
            lambda m: f"{m['ratios'][f'http_{most}_clients_over_raw_ort']:#.3g}"),
        row("missing / error results, non-200", lambda m: (
            f"{m['missing']} / {m['errors']}, {sum(h['failures'] for h in m['http'].values())}")),
        row("  the plain loop's missing, paced", lambda m: str(sum(
            phase["missing"] for phase in m["plain_loop_paced"].values() if phase))),
    ]


def loop_drains(model: dict[str, Any], client: str) -> str:
    """A plain loop's capacity, with its drains when it had more than one (the median of them)."""
    drains = model["plain_loop_drains"][client]
    return f"{model['plain_loop'][client]:,.0f}" + (
        f" (median of its drains: {', '.join(f'{rate:,.0f}' for rate in drains)})" if len(drains) > 1 else "")


def all_drains(model: dict[str, Any]) -> str:
    """The running job's drains in turn, a lower bound marked "at least"."""
    return ", ".join(f"{'at least ' if drain['bound_by_writer'] else ''}{drain['capacity']:,.0f}"
                     for drain in model["running_drains"])


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def json_safe(value: Any) -> Any:
    """NaN and infinities as null: strict JSON readers refuse them."""
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value

