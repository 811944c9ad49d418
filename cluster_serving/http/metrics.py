"""The bridge's metrics: what it times and counts, shown as BigDL/Dropwizard-style JSON on
`/metrics` and as Prometheus text on `/metrics/prometheus`.

pyformance is the engine, and this module is the only one that knows it: the rest of the bridge
times and counts through `BridgeMetrics`' methods. Only pyformance's public API is used: its
Timer and Counter built directly (a MetricsRegistry would only be a second dict of the same
metrics, and it has no public way to list them), and a time measured elsewhere (the job's
inference time) recorded on the timer's public histogram and meter, which is all that the
private `Timer._update` behind `Timer.time()` does for a timer without a sink.

Timers record seconds; both views show milliseconds, as the BigDL programming guide does.

Per model and version (the version that served the request, else the one it named, else
"latest"), besides the totals: the requests' timer `cluster_serving.http.request.<model>.<version>`,
their failures `cluster_serving.http.errors.<model>.<version>` and the job's inference time
`cluster_serving.job.inference.<model>.<version>`. In the JSON each such entry also has `model`
and `version` keys; in Prometheus' text they are one metric family each, labelled
(`cluster_serving_http_model_request_seconds{model="a",version="2",quantile="0.5"}`).
"""

from __future__ import annotations

import re
import warnings
from contextlib import AbstractContextManager
from typing import Any

# pyformance 0.4 (unmaintained, see docs/development.md) imports the deprecated pkg_resources at import time.
warnings.filterwarnings("ignore", message=".*pkg_resources")
from pyformance.meters import Counter, Timer  # noqa: E402

PREFIX = "cluster_serving.http"
REQUEST = f"{PREFIX}.request"            # a whole HTTP predict/infer request
ENQUEUE = f"{PREFIX}.enqueue"            # encoding + handing its instances to the producer
WAIT_RESULT = f"{PREFIX}.wait_result"    # from enqueued until every result is in
INFERENCE = "cluster_serving.job.inference"  # the job's inference time of the batch each result ran in
REQUESTS_BY_STATUS = f"{PREFIX}.responses"  # + ".<status>": counters
LATE_RESULTS = f"{PREFIX}.late_results"
MODEL_ERRORS = f"{PREFIX}.errors"        # + ".<model>.<version>": failed requests
# Per model version: (the total's name, the Prometheus family); a name is "<total>.<model>.<version>".
BY_MODEL = {REQUEST: "cluster_serving_http_model_request", INFERENCE: "cluster_serving_job_model_inference",
            MODEL_ERRORS: "cluster_serving_http_model_errors"}
PERCENTILES = (("_75thPercentile", 0.75), ("_95thPercentile", 0.95), ("_98thPercentile", 0.98),
               ("_99thPercentile", 0.99), ("_999thPercentile", 0.999))
TIMER_FIELDS = ("min", "max", "mean", "median", "stdDev", *(label for label, _ in PERCENTILES))


class BridgeMetrics:
    """The bridge's timers and counters by name; a response counter appears with its first status."""

    def __init__(self) -> None:
        self._timers: dict[str, Timer] = {}
        self._counters: dict[str, Counter] = {}
        # metric name -> (the total's name, model, version) for the per-model-version ones
        self._labels: dict[str, tuple[str, str, str]] = {}
        self._by_model: dict[tuple[str, str, str], Timer | Counter] = {}
        self._request = self._timer(REQUEST)
        self._enqueue = self._timer(ENQUEUE)
        self._wait_result = self._timer(WAIT_RESULT)
        self._inference = self._timer(INFERENCE)
        self._late_results = self._counter(LATE_RESULTS)

    def _timer(self, name: str) -> Timer:
        if name not in self._timers:
            self._timers[name] = Timer()
        return self._timers[name]

    def _counter(self, name: str) -> Counter:
        if name not in self._counters:
            self._counters[name] = Counter()
        return self._counters[name]

    def _model_metric(self, total: str, model: str, version: str, kind: type[Timer] | type[Counter]) -> Timer | Counter:
        key = (total, model, version)
        metric = self._by_model.get(key)
        if metric is None:
            name = f"{total}.{model}.{version}"
            metric = self._timer(name) if kind is Timer else self._counter(name)
            self._labels[name] = key
            self._by_model[key] = metric
        return metric

    def _all(self) -> list[tuple[str, Timer | Counter]]:
        return sorted({**self._timers, **self._counters}.items())

    def time_request(self) -> AbstractContextManager[None]:
        """Times a predict request, from reading its instances until every result is in."""
        return self._request.time()

    def time_enqueue(self) -> AbstractContextManager[None]:
        """Times encoding a request's instances."""
        return self._enqueue.time()

    def time_wait_result(self) -> AbstractContextManager[None]:
        """Times a request's wait for its results."""
        return self._wait_result.time()

    def count_response(self, status: int) -> None:
        self._counter(f"{REQUESTS_BY_STATUS}.{status}").inc()

    def count_late_result(self) -> None:
        """A result that came after its request gave up."""
        self._late_results.inc()

    def record_model_request(self, model: str, version: str, seconds: float, ok: bool) -> None:
        """One predict request for `model`'s `version` (served, named or "latest") and its time."""
        timer = self._model_metric(REQUEST, model, version, Timer)
        timer.hist.add(seconds)
        timer.meter.mark()
        if not ok:
            self._model_metric(MODEL_ERRORS, model, version, Counter).inc()

    def record_inference_us(self, micros: int, model: str | None = None, version: int | None = None) -> None:
        """The job's inference time for one result, measured by the job; also under the model
        version that served it, where the result says which."""
        if micros >= 0:
            self._inference.hist.add(micros / 1_000_000)
            self._inference.meter.mark()
            if model is not None:
                timer = self._model_metric(INFERENCE, model, "latest" if version is None else str(version), Timer)
                timer.hist.add(micros / 1_000_000)
                timer.meter.mark()

    def dropwizard(self) -> list[dict[str, Any]]:
        """One entry per metric, timer fields named as in the BigDL guide, times in ms."""
        entries = []
        for name, metric in self._all():
            labels = self._labels.get(name)
            entry: dict[str, Any] = {"name": name}
            if labels is not None:
                entry.update(model=labels[1], version=labels[2])
            if isinstance(metric, Timer):
                entries.append({**entry, **_timer_fields(metric)})
            else:
                entries.append({**entry, "count": metric.get_count()})
        return entries

    def prometheus(self) -> str:
        """Prometheus text format: each timer a summary in seconds, each counter a counter."""
        lines = []
        for name, metric in self._all():
            if name in self._labels:
                continue
            metric_name = re.sub(r"[^a-zA-Z0-9_]", "_", name)
            if isinstance(metric, Timer):
                lines.extend(_summary_lines(metric_name, metric))
            else:
                lines.append(f"# TYPE {metric_name}_total counter")
                lines.append(f"{metric_name}_total {metric.get_count()}")
        for total, family in BY_MODEL.items():
            metrics = sorted((key[1:], metric) for key, metric in self._by_model.items() if key[0] == total)
            if not metrics:
                continue
            if total == MODEL_ERRORS:
                lines.append(f"# TYPE {family}_total counter")
                lines.extend(f"{family}_total{{{_labels(*key)}}} {metric.get_count()}" for key, metric in metrics)
                continue
            lines.append(f"# TYPE {family}_seconds summary")
            for (model, version), metric in metrics:
                assert isinstance(metric, Timer)
                lines.extend(_summary_lines(family, metric, _labels(model, version))[1:])
        return "\n".join(lines) + "\n"


def _labels(model: str, version: str) -> str:
    return f'model="{_escaped(model)}",version="{_escaped(version)}"'


def _escaped(value: str) -> str:
    """A Prometheus label value: backslash, quote and newline escaped (model.name may hold them)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _summary_lines(metric_name: str, timer: Timer, labels: str = "") -> list[str]:
    snapshot = timer.get_snapshot()
    lines = [f"# TYPE {metric_name}_seconds summary"]
    both = f"{labels}," if labels else ""
    for label, quantile in (("0.5", 0.5), *((str(q), q) for _, q in PERCENTILES)):
        lines.append(f'{metric_name}_seconds{{{both}quantile="{label}"}} {snapshot.get_percentile(quantile)}')
    braces = f"{{{labels}}}" if labels else ""
    lines.append(f"{metric_name}_seconds_sum{braces} {timer.get_sum()}")
    lines.append(f"{metric_name}_seconds_count{braces} {int(timer.get_count())}")
    return lines


def _timer_fields(timer: Timer) -> dict[str, Any]:
    count = int(timer.get_count())
    if not count:  # pyformance reports +-2**31 s as min/max of an empty timer
        return {"count": 0, "meanRate": 0.0, **{field: 0.0 for field in TIMER_FIELDS}}
    snapshot = timer.get_snapshot()
    ms = 1000.0
    fields = {
        "count": count,
        "meanRate": timer.get_mean_rate(),
        "min": timer.get_min() * ms,
        "max": timer.get_max() * ms,
        "mean": timer.get_mean() * ms,
        "median": snapshot.get_median() * ms,
        "stdDev": timer.get_stddev() * ms,
    }
    fields.update({label: snapshot.get_percentile(q) * ms for label, q in PERCENTILES})
    return fields
