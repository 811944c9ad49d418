"""What `cluster-serving status` and `stop` need: the record `start` leaves of what it started,
and a look at the job through the Flink REST API, Kafka and the HTTP bridge."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from conf import JOB_NAME, ServingConfig
from connectors.admin import broker_reachable, client_properties, consumer_lag, records_written
from connectors.flink_rest import FlinkRest
from ops.processes import pid_alive

STATE_FILE = ".cluster-serving.json"
RATE_SAMPLE_S = 1.0


@dataclass
class StartRecord:
    """Written by `cluster-serving start` next to its config, removed when it exits."""

    pid: int
    started_at: float
    flink_log_dir: str

    @staticmethod
    def path_for(config: ServingConfig) -> Path:
        return config.folder / STATE_FILE

    def write(self, config: ServingConfig) -> None:
        self.path_for(config).write_text(json.dumps(asdict(self)))

    @classmethod
    def read(cls, config: ServingConfig) -> StartRecord | None:
        """The record, or None when there is none or its process is gone (a stale file is removed)."""
        path = cls.path_for(config)
        try:
            record = cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None
        if not pid_alive(record.pid):
            path.unlink(missing_ok=True)
            return None
        return record


def stop_started(record: StartRecord, timeout_s: float) -> bool:
    """SIGTERM to the `start` process (which stops the job with a final savepoint and the bridge);
    True once it has exited."""
    os.kill(record.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_alive(record.pid):
            return True
        time.sleep(0.2)
    return False


def bridge_state(config: ServingConfig) -> str:
    host = "127.0.0.1" if config.http.host in ("0.0.0.0", "::") else config.http.host
    url = f"http://{host}:{config.http.port}/v2/health/ready"
    try:
        with urllib.request.urlopen(url, timeout=3):
            return f"ready on http://{host}:{config.http.port}"
    except urllib.error.HTTPError as error:
        return f"not ready ({json.loads(error.read() or b'{}').get('error', error.code)})"
    except OSError:
        return f"not running (nothing answers on {host}:{config.http.port})"


def kafka_figures(config: ServingConfig) -> dict[str, object]:
    """Input lag of the job's group, and requests in / results out per second over one second."""
    kafka = config.kafka
    if not broker_reachable(kafka.bootstrap_servers):
        return {"broker": f"not reachable at {kafka.bootstrap_servers}"}
    properties = client_properties(kafka)
    topics = [kafka.input_topic, kafka.result_topic]
    before = records_written(kafka.bootstrap_servers, topics, **properties)
    started = time.monotonic()
    time.sleep(RATE_SAMPLE_S)
    after = records_written(kafka.bootstrap_servers, topics, **properties)
    elapsed = time.monotonic() - started
    return {
        "broker": kafka.bootstrap_servers,
        "input lag": consumer_lag(kafka.bootstrap_servers, kafka.input_topic, kafka.group_id, **properties),
        "requests/s in": round((after[kafka.input_topic] - before[kafka.input_topic]) / elapsed, 1),
        "results/s out": round((after[kafka.result_topic] - before[kafka.result_topic]) / elapsed, 1),
    }


def status_lines(config: ServingConfig) -> tuple[list[str], bool]:
    """The lines `cluster-serving status` prints, and whether the job runs."""
    record = StartRecord.read(config)
    lines = [f"started here: pid {record.pid}, {time.ctime(record.started_at)}" if record
             else "started here: no (no running `cluster-serving start` for this config)"]
    job = FlinkRest(config.http.flink_rest_url, timeout_s=3.0).find_job(JOB_NAME)
    running = isinstance(job, dict) and job["state"] == "RUNNING"
    if isinstance(job, dict):
        lines.append(f"job: {job['state']} ({job['jid']}, up {job['duration'] // 1000} s)")
    else:
        lines.append(f"job: {job}")
    lines.append(f"Flink web UI: {config.http.flink_rest_url}")
    lines += [f"{key}: {value}" for key, value in kafka_figures(config).items()]
    lines.append(f"HTTP bridge: {bridge_state(config)}")
    if record:
        lines.append(f"Flink log: {record.flink_log_dir}")
    return lines, running
