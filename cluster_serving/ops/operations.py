"""The start-up checks of `start` and `demo` (against the config, the machine and the running
instances of cluster_serving/ops/instances.py), and a look at a running job through the Flink REST API, Kafka and
the HTTP bridge for `status`.
"""

from __future__ import annotations

import json
import os
import ssl
import time
import urllib.error
import urllib.request

from cluster_serving.config import JOB_NAME, RESTART_SIGNAL, ConfigError, ServingConfig
from cluster_serving.jvm import find_java, pipeline_jars
from cluster_serving.kafka.admin import (
    broker_problem,
    consumer_lag,
    kafka_answers,
    records_written,
    unreachable,
)
from cluster_serving.kafka.clients import check_properties
from cluster_serving.kafka.connection import KafkaConnection
from cluster_serving.net.flink_rest import FlinkRest, FlinkRestError
from cluster_serving.net.ports import port_taken
from cluster_serving.ops.children import LocalBroker
from cluster_serving.ops.instances import Instance, commands_for
from cluster_serving.ops.local_broker import kafka_version
from cluster_serving.ops.processes import listener_of, pid_alive
from cluster_serving.runtime.repository import check_stages
from cluster_serving.runtime.signature import repository_signatures

RATE_SAMPLE_S = 1.0


def broker_address(config: ServingConfig) -> tuple[str, int]:
    """The host and port of a single local bootstrap address; anything else is not ours to start."""
    host, _, port = config.kafka.bootstrap_servers.rpartition(":")
    if "," in config.kafka.bootstrap_servers or host not in ("127.0.0.1", "localhost") or not port.isdigit():
        raise ConfigError(
            f"kafka.bootstrap_servers: a local broker needs one 127.0.0.1:PORT address, "
            f"got {config.kafka.bootstrap_servers!r}"
        )
    return "127.0.0.1", int(port)


def broker_to_start(config: ServingConfig) -> int | None:
    """The port of the local broker a start runs: None when something listens there already
    (a broker to use, which check_start makes sure of)."""
    host, port = broker_address(config)
    return None if port_taken(host, port) else port


def check_start(config: ServingConfig, http: bool, local_broker: bool) -> None:
    """What `start` and `demo` check in the CLI's own process before anything starts, so that a
    mistake is one line and leaves nothing running: the files, every served model version against
    its config, Java and the jars, the ports the job and the bridge listen on, and the broker (a running one, or
    what starting the local one needs), and the bridge's Kafka properties."""
    check_job(config)
    check_port("flink.rest_port", "127.0.0.1", config.flink.rest_port)
    if http:
        check_port("http.port", config.http.host, config.http.port)
        check_properties(config.kafka)  # the bridge's Kafka client knows names the others do not
    if not local_broker:
        if problem := broker_problem(config.kafka):
            raise unreachable(config.kafka.bootstrap_servers, problem)
    elif broker_to_start(config):
        kafka_version()  # the broker's jars are there
    elif not kafka_answers(config.kafka.bootstrap_servers):
        host, port = broker_address(config)
        holder = listener_of(port) or "a process"
        raise ConfigError(
            f"kafka.bootstrap_servers: {host}:{port} is in use by {holder}, which is not a Kafka broker; "
            "stop it or set another port"
        )


def check_job(config: ServingConfig) -> None:
    """What the job needs of the config and the machine: its files, every served model version
    against its config, Java and the jars."""
    config.check_files()
    repository, _ = repository_signatures(config)  # every served version readable and as its servable.yaml says
    check_stages(repository)
    find_java()
    pipeline_jars(config.flink)  # listed jars there; the default ones made on first use


def restart_job(config: ServingConfig, instance: Instance, timeout_s: float) -> dict:
    """Has a `start` instance restart its job (RESTART_SIGNAL: a final savepoint, then the job
    again from it, with the config as it reads now) and returns the details of the new job once
    every task of it runs. Its config is checked first: a mistake stops nothing."""
    check_job(config)
    moved = instance.ports_moved(config)
    if moved:
        raise ConfigError(f"the config moves {', '.join(moved)} of the running instance: stop and start it instead")
    flink = FlinkRest(f"http://127.0.0.1:{config.flink.rest_port}")
    before = flink.find_job(JOB_NAME)
    os.kill(instance.pid, RESTART_SIGNAL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and pid_alive(instance.pid):
        job = flink.find_job(JOB_NAME)
        if isinstance(job, dict) and job["state"] == "RUNNING" and (not isinstance(before, dict) or job["jid"] != before["jid"]):
            flink.wait_until_running(job["jid"], deadline - time.monotonic())
            return flink.job(job["jid"])
        time.sleep(0.5)
    if not pid_alive(instance.pid):
        raise ConfigError(f"{instance.name} ended while its job restarted: its output says why")
    raise ConfigError(f"no new job runs after {timeout_s:g} s; {instance.command_for('status')} says where it is")


def check_port(key: str, host: str, port: int) -> None:
    """A port the job or the bridge will listen on must be free now (0: any free port)."""
    if port and port_taken(host, port):
        holder = listener_of(port)
        raise ConfigError(f"{key}: {host}:{port} is in use{f' by {holder}' if holder else ''}; stop it or set another {key}")


def bridge_state(config: ServingConfig) -> str:
    host = "127.0.0.1" if config.http.host in ("0.0.0.0", "::") else config.http.host
    base = f"{config.http.scheme}://{host}:{config.http.port}"
    # A liveness probe of this machine's own bridge: its certificate may name another host.
    unverified = None
    if config.http.tls_cert:
        unverified = ssl.create_default_context()
        unverified.check_hostname, unverified.verify_mode = False, ssl.CERT_NONE
    try:
        with urllib.request.urlopen(f"{base}/v2/health/ready", timeout=3, context=unverified):
            return f"ready on {base}"
    except urllib.error.HTTPError as error:
        return f"not ready ({json.loads(error.read() or b'{}').get('error', error.code)})"
    except OSError:
        return f"not running (nothing answers on {host}:{config.http.port})"


def source_backlog(flink: FlinkRest, job_id: str) -> int | None:
    """Input records the running job has not read yet: Flink's standard `pendingRecords` metric of
    its Kafka source, summed over the source's subtasks; None until the source reports it. Found
    by the metric's name, whatever the source operator is called."""
    try:
        for vertex in flink.job(job_id)["vertices"]:
            base = f"/jobs/{job_id}/vertices/{vertex['id']}"
            names = {metric["id"].split(".", 1)[1] for metric in flink.get(f"{base}/metrics")
                     if metric["id"].endswith(".pendingRecords")}
            if names:
                sums = flink.get(f"{base}/subtasks/metrics?get={','.join(sorted(names))}&agg=sum")
                return round(sum(float(item.get("sum", 0)) for item in sums))
    except (FlinkRestError, KeyError, ValueError):
        return None
    return None


def lag_text(backlog: int | None, committed: int, group: str) -> str:
    """The input lag, and why there are two figures: the job commits its group's offsets only when
    a checkpoint completes, and its Kafka source sends that commit from the fetcher's thread,
    which sits in a poll of up to 10 s on an idle topic. So the committed lag trailed by the last
    8-12 s of requests (6-8 after the demo, with everything answered), while the source's
    `pendingRecords`, what the job has not read, is 0 when it is idle."""
    committed_text = f"{committed} past group {group}'s committed offsets, which the job moves on checkpoints"
    if backlog is None:
        return committed_text
    if backlog == committed:
        return f"{backlog} (not read by the job yet)"
    return f"{backlog} (not read by the job yet; {committed_text})"


def kafka_figures(config: ServingConfig, backlog: int | None) -> dict[str, object]:
    """The input lag, and requests in / results out per second over one second."""
    kafka = config.kafka
    if problem := broker_problem(kafka):
        return {"broker": f"not usable at {kafka.bootstrap_servers}: {problem}"}
    properties = KafkaConnection.of(kafka).kafka_python()
    topics = [kafka.input_topic, kafka.result_topic]
    before = records_written(topics, **properties)
    started = time.monotonic()
    time.sleep(RATE_SAMPLE_S)
    after = records_written(topics, **properties)
    elapsed = time.monotonic() - started
    committed = consumer_lag(kafka.bootstrap_servers, kafka.input_topic, kafka.group_id, kafka.properties)
    return {
        "broker": kafka.bootstrap_servers,
        "input lag": lag_text(backlog, committed, kafka.group_id),
        "requests/s in": round((after[kafka.input_topic] - before[kafka.input_topic]) / elapsed, 1),
        "results/s out": round((after[kafka.result_topic] - before[kafka.result_topic]) / elapsed, 1),
    }


def status_lines(config: ServingConfig, instance: Instance | None) -> tuple[list[str], bool]:
    """The lines `cluster-serving status` prints, and whether the job runs."""
    if instance:
        lines = [f"instance: {instance.name}, since {time.ctime(instance.started_at)}"]
    else:
        others = commands_for("status")
        lines = [f"instance: none runs with this config{f' (running: {others})' if others else ''}"]
    flink = FlinkRest(config.http.flink_rest_url, timeout_s=3.0)
    job = flink.find_job(JOB_NAME)
    running = isinstance(job, dict) and job["state"] == "RUNNING"
    if isinstance(job, dict):
        lines.append(f"job: {job['state']} ({job['jid']}, up {job['duration'] // 1000} s)")
    else:
        lines.append(f"job: {job}")
    lines.append(f"Flink web UI: {config.http.flink_rest_url}")
    backlog = source_backlog(flink, job["jid"]) if running else None
    lines += [f"{key}: {value}" for key, value in kafka_figures(config, backlog).items()]
    lines.append(f"HTTP bridge: {bridge_state(config)}")
    lines.append(f"Flink log: {instance.flink_log_dir if instance else config.flink_log_dir}")
    return lines, running


def start_local_broker(config: ServingConfig, fresh: bool = False) -> LocalBroker | None:
    """Starts the local Kafka broker on the configured port, its data next to the config file
    (`kafka/`), unless a broker already listens there (check_start made sure it is one)."""
    if broker_to_start(config) is None:
        print(f"using the Kafka broker already listening on {config.kafka.bootstrap_servers}")
        return None
    _, port = broker_address(config)
    broker = LocalBroker(config.folder / "kafka", port=port, log_path=config.folder / "kafka.log", fresh=fresh)
    broker.start()
    print(f"local Kafka broker on {broker.bootstrap_servers} (ready in {broker.ready_seconds:.1f} s; data: {broker.data})")
    return broker
