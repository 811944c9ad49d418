"""The bridge's metrics: pyformance timers and counters, shown as BigDL/Dropwizard-style JSON on
`/metrics` and as Prometheus text on `/metrics/prometheus`.

Timers record seconds; both views show milliseconds, as the BigDL programming guide does.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

# pyformance 0.4 (unmaintained, see README) imports the deprecated pkg_resources at import time.
warnings.filterwarnings("ignore", message=".*pkg_resources")
from pyformance import MetricsRegistry  # noqa: E402
from pyformance.meters import Counter, Timer  # noqa: E402

PREFIX = "cluster_serving.http"
REQUEST = f"{PREFIX}.request"            # a whole HTTP predict/infer request
ENQUEUE = f"{PREFIX}.enqueue"            # encoding + handing its instances to the producer
WAIT_RESULT = f"{PREFIX}.wait_result"    # from enqueued until every result is in
INFERENCE = "cluster_serving.job.inference"  # the job's inference time of the batch each result ran in
REQUESTS_BY_STATUS = f"{PREFIX}.responses"  # + ".<status>": counters
LATE_RESULTS = f"{PREFIX}.late_results"
PERCENTILES = (("_75thPercentile", 0.75), ("_95thPercentile", 0.95), ("_98thPercentile", 0.98),
               ("_99thPercentile", 0.99), ("_999thPercentile", 0.999))


TIMER_FIELDS = ("min", "max", "mean", "median", "stdDev", *(label for label, _ in PERCENTILES))


class BridgeMetrics:
    def __init__(self) -> None:
        self.registry = MetricsRegistry()
        # pyformance has no public way to list a registry's metrics: keep them by name here.
        self._metrics: dict[str, Timer | Counter] = {}
        self.request = self._timer(REQUEST)
        self.enqueue = self._timer(ENQUEUE)
        self.wait_result = self._timer(WAIT_RESULT)
        self.inference = self._timer(INFERENCE)
        self.late_results = self._counter(LATE_RESULTS)

    def _timer(self, name: str) -> Timer:
        return self._metrics.setdefault(name, self.registry.timer(name))

    def _counter(self, name: str) -> Counter:
        return self._metrics.setdefault(name, self.registry.counter(name))

    def count_response(self, status: int) -> None:
        self._counter(f"{REQUESTS_BY_STATUS}.{status}").inc()

    def record_inference_us(self, micros: int) -> None:
        self.inference._update(micros / 1_000_000)  # pyformance's own entry for a measured time

    def dropwizard(self) -> list[dict[str, Any]]:
        """One entry per metric, timer fields named as in the BigDL guide, times in ms."""
        entries = []
        for name, metric in sorted(self._metrics.items()):
            if isinstance(metric, Timer):
                entries.append({"name": name, **_timer_fields(metric)})
            else:
                entries.append({"name": name, "count": metric.get_count()})
        return entries

    def prometheus(self) -> str:
        """Prometheus text format: each timer a summary in seconds, each counter a counter."""
        lines = []
        for name, metric in sorted(self._metrics.items()):
            metric_name = re.sub(r"[^a-zA-Z0-9_]", "_", name)
            if isinstance(metric, Timer):
                snapshot = metric.get_snapshot()
                lines.append(f"# TYPE {metric_name}_seconds summary")
                for label, quantile in (("0.5", 0.5), *((str(q), q) for _, q in PERCENTILES)):
                    lines.append(f'{metric_name}_seconds{{quantile="{label}"}} {snapshot.get_percentile(quantile)}')
                lines.append(f"{metric_name}_seconds_sum {metric.get_sum()}")
                lines.append(f"{metric_name}_seconds_count {int(metric.get_count())}")
            else:
                lines.append(f"# TYPE {metric_name}_total counter")
                lines.append(f"{metric_name}_total {metric.get_count()}")
        return "\n".join(lines) + "\n"


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

