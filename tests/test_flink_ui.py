"""What a user sees of a running job in the Flink web UI and in the logs: the job graph reads as
the data flow, the job's own metrics have short names in the UI's metric picker, and neither log
repeats a line every few seconds."""

from __future__ import annotations

import html
import re
import time
from collections import Counter

from tests.conftest import assert_served

# The operators of the job's one chained vertex (parallelism 1), in the order records pass them.
DATA_FLOW = [
    "Source: kafka-requests", "micro-batch", "infer", "split-results", "kafka-results: Writer", "kafka-results: Committer",
]
METRICS = ["requests", "decodeErrors", "deadlineExceeded", "batchSize", "inferenceTimeUs", "inferenceErrors", "requestsServed", "deadLetters"]
# The web UI's metric picker is 300 px wide: about 40 characters of a metric's name show.
PICKER_CHARS = 40
# A log record's first line: its timestamp, then what repeats if the record does.
RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (.*)$")
QUIET_SECONDS = 15


def repeated_records(text: str) -> dict[str, int]:
    """The log records (timestamps left out) found more than twice in `text`."""
    counts = Counter(match.group(1) for line in text.splitlines() if (match := RECORD.match(line)))
    return {record: count for record, count in counts.items() if count > 2}


def test_web_ui_reads_as_the_data_flow_and_logs_do_not_repeat(write_config, start_job) -> None:
    path, config = write_config()
    job = start_job(path, config)
    assert_served(config, 50, seed=3, timeout=60)

    details = job.rest(f"/jobs/{job.job_id}")
    assert [vertex["name"].split(" -> ") for vertex in details["vertices"]] == [DATA_FLOW]
    # The fused Python stages are one operator, "infer"; its description names them.
    description = html.unescape(details["plan"]["nodes"][0]["description"])
    assert "decode -> ONNX Runtime (model v1) -> encode" in description, description

    vertex = details["vertices"][0]["id"]
    wanted = {f"0.infer.cluster_serving.{name}" for name in METRICS}
    listed: set[str] = set()
    deadline = time.monotonic() + 60  # the REST API lists an operator's metrics a few seconds late
    while not wanted <= listed and time.monotonic() < deadline:
        listed = {item["id"] for item in job.rest(f"/jobs/{job.job_id}/vertices/{vertex}/metrics")}
        time.sleep(1)
    assert wanted <= listed, f"not listed: {sorted(wanted - listed)}"
    assert all(len(name) <= PICKER_CHARS for name in wanted), sorted(wanted)
    per_version = f"0.infer.cluster_serving.model.{config.model.name}.version.1.batchSize"
    assert per_version in listed, sorted(listed)
    counted = 0
    while counted < 50 and time.monotonic() < deadline:
        [requests] = job.rest(f"/jobs/{job.job_id}/vertices/{vertex}/metrics?get=0.infer.cluster_serving.requests")
        counted = int(requests["value"])
        time.sleep(1)
    assert counted >= 50

    # Running and idle for a while, with a checkpoint every second: nothing comes back each time.
    flink_log = next(config.flink_log_dir.glob("flink-*.log"))
    start = flink_log.stat().st_size
    time.sleep(QUIET_SECONDS)
    with flink_log.open("rb") as log:
        log.seek(start)
        recent = log.read().decode(errors="replace")
    assert "Completed checkpoint" in recent, "the window saw no checkpoint"
    assert repeated_records(recent) == {}
    assert repeated_records(job.log_path.read_text(errors="replace")) == {}
