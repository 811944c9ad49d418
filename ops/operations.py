"""What the CLI knows of running instances, and checks before it starts one.

A running `cluster-serving start` or `demo` keeps a record of what it uses (ports, the input
topic's consumer group, the Flink log and checkpoint folders) in `.cluster-serving.json` next to
its config, locked with flock for the process's life: the kernel drops the lock when the process
ends, however it ends, so a record that nobody holds is stale. A link in a per-user folder
(`registry()`) points at each record, so that a new instance, `status` and `stop` also find the
instances of other folders. Then: the start-up checks of `start` and `demo`, and a look at a
running job through the Flink REST API, Kafka and the HTTP bridge for `status`.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from bridge.server import model_signature
from conf import JOB_NAME, ConfigError, ServingConfig, load_config
from connectors.admin import (
    broker_reachable, client_properties, consumer_lag, kafka_answers, records_written, unreachable,
)
from connectors.flink_rest import FlinkRest, FlinkRestError
from connectors.local_broker import find_java, kafka_version, port_taken
from ops.processes import listener_of, pid_alive

RECORD_FILE = ".cluster-serving.json"
# The folder of links to live instances' records; the tests give it a folder of their own.
REGISTRY_ENV = "CLUSTER_SERVING_RUN_DIR"
RATE_SAMPLE_S = 1.0


@dataclass(frozen=True)
class Instance:
    """A running `cluster-serving start` or `demo` as its record describes it."""

    pid: int
    command: str
    config: str  # the config file; "" for the defaults alone, read in `folder`
    folder: str
    started_at: float
    ports: dict[str, int]
    bootstrap_servers: str
    input_topic: str
    group_id: str
    flink_log_dir: str
    checkpoint_dir: str

    @classmethod
    def of(cls, command: str, config: ServingConfig, http: bool, broker_port: int | None) -> Instance:
        """This process as the instance `config` makes it. `broker_port`: the local broker's port,
        with `--local-broker` and for the demo: two instances that both want to run the local
        broker on one port would share one broker, which stops with the instance that started it."""
        ports = {"flink.rest_port": config.flink.rest_port}
        if http:
            ports["http.port"] = config.http.port
        if broker_port:
            ports["its local broker"] = broker_port
        kafka = config.kafka
        return cls(
            pid=os.getpid(), command=command, config=str(config.source or ""), folder=str(config.folder),
            started_at=time.time(), ports=ports, bootstrap_servers=kafka.bootstrap_servers,
            input_topic=kafka.input_topic, group_id=kafka.group_id,
            flink_log_dir=str(config.flink_log_dir), checkpoint_dir=str(config.flink.checkpoint_dir),
        )

    @property
    def name(self) -> str:
        where = f"config {self.config}" if self.config else f"the default config in {self.folder}"
        return f"`cluster-serving {self.command}` (pid {self.pid}, {where})"

    def command_for(self, verb: str) -> str:
        """The command line that reaches this instance: `cluster-serving stop -c ...`."""
        if self.config:
            return f"cluster-serving {verb} -c {self.config}"
        return f"cluster-serving {verb} (in {self.folder})"

    def shares_with(self, other: Instance) -> list[str]:
        """What this instance would use that `other` uses: a port, the input topic's consumer
        group on the same broker, the Flink log folder, the checkpoint folder."""
        taken = set(other.ports.values()) - {0}
        shared = [f"port {port} ({role})" for role, port in self.ports.items() if port in taken]
        if (_addresses(self.bootstrap_servers) & _addresses(other.bootstrap_servers)
                and (self.input_topic, self.group_id) == (other.input_topic, other.group_id)):
            shared.append(f"consumer group {self.group_id} of topic {self.input_topic}")
        if self.flink_log_dir == other.flink_log_dir:
            shared.append(f"the Flink log folder {self.flink_log_dir}")
        if self.checkpoint_dir == other.checkpoint_dir:
            shared.append(f"the checkpoint folder {self.checkpoint_dir}")
        return shared


def _addresses(bootstrap_servers: str) -> set[str]:
    return {address.strip().replace("localhost", "127.0.0.1") for address in bootstrap_servers.split(",")}


class Claim:
    """This process's record, locked and linked from the registry until `release()` (or exit)."""

    def __init__(self, record: Path, descriptor: int, link: Path):
        self.record, self.descriptor, self.link = record, descriptor, link

    def release(self) -> None:
        self.link.unlink(missing_ok=True)
        self.record.unlink(missing_ok=True)
        os.close(self.descriptor)


def claim(instance: Instance) -> Claim:
    """Records `instance`, or refuses with one line naming the instance in the way: the one whose
    record next to this config is held, or any live one that uses something this one would use.
    The record is written and linked before the others are read, so two instances started at the
    same moment see each other (both refuse) rather than neither."""
    record = Path(instance.folder) / RECORD_FILE
    descriptor = _lock(record)
    if descriptor is None:
        holder = read_record(record)
        who = holder.name if holder else f"another instance (its record {record} is locked)"
        stop = f": {holder.command_for('stop')}" if holder else ""
        raise ConfigError(f"{who} already runs in {instance.folder}; stop it first{stop}")
    os.ftruncate(descriptor, 0)
    os.write(descriptor, json.dumps(asdict(instance)).encode())
    held = Claim(record, descriptor, _link(record, instance.pid))
    for other in live_instances():
        shared = other.shares_with(instance) if other.pid != instance.pid else []
        if shared:
            held.release()
            raise ConfigError(
                f"{other.name} already uses {', '.join(shared)}; stop it first "
                f"({other.command_for('stop')}) or change these in this config"
            )
    return held


def _lock(record: Path) -> int | None:
    """A descriptor of `record` holding its exclusive flock, or None while another process holds
    it. A record removed (by its stopping owner) between open and lock is opened again."""
    while True:
        descriptor = os.open(record, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            return None
        try:
            if os.stat(record).st_ino == os.fstat(descriptor).st_ino:
                return descriptor
        except FileNotFoundError:
            pass
        os.close(descriptor)


def _held(record: Path) -> bool:
    """True while a live process holds the record's lock."""
    try:
        descriptor = os.open(record, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(descriptor)
    return False


def read_record(record: Path) -> Instance | None:
    """The record's instance; None when there is none or it is being written."""
    try:
        return Instance(**json.loads(record.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def registry() -> Path:
    """The per-user folder of links to live instances' records: $CLUSTER_SERVING_RUN_DIR, else
    $XDG_RUNTIME_DIR/cluster-serving, else cluster-serving-<uid> in the temp folder."""
    if os.environ.get(REGISTRY_ENV):
        folder = Path(os.environ[REGISTRY_ENV])
    elif os.environ.get("XDG_RUNTIME_DIR"):
        folder = Path(os.environ["XDG_RUNTIME_DIR"]) / "cluster-serving"
    else:
        folder = Path(tempfile.gettempdir()) / f"cluster-serving-{os.getuid()}"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder


def _link(record: Path, pid: int) -> Path:
    link = registry() / str(pid)
    staging = link.with_name(f".{pid}.new")
    staging.unlink(missing_ok=True)
    staging.symlink_to(record)
    staging.replace(link)
    return link


def live_instances() -> list[Instance]:
    """Every instance whose record is held now, oldest first; links to records that nobody holds,
    or that another process holds now, are removed on the way."""
    found = []
    for link in registry().iterdir():
        if link.name.startswith("."):
            continue
        try:
            record = Path(os.readlink(link))
        except OSError:
            link.unlink(missing_ok=True)
            continue
        held = _held(record)
        instance = read_record(record) if held else None
        if instance is not None and str(instance.pid) == link.name:
            found.append(instance)
        elif not held or instance is not None:  # held and unreadable: being written, kept
            link.unlink(missing_ok=True)
    return sorted(found, key=lambda instance: instance.started_at)


def recorded(config: ServingConfig) -> Instance | None:
    """The live instance whose record is next to `config`, when it runs with that config."""
    record = config.folder / RECORD_FILE
    instance = read_record(record) if _held(record) else None
    return instance if instance and instance.config == str(config.source or "") else None


def find_instance(config_path: str | None, verb: str) -> tuple[ServingConfig, Instance | None]:
    """The config and the running instance that `status` and `stop` mean. With -c: that config's
    instance, when it runs. Without: the default config's in the working folder, else the only
    one running (a `demo` too); several are an error that gives each one's command line."""
    config = load_config(config_path)
    instance = recorded(config)
    if instance or config_path:
        return config, instance
    running = live_instances()
    if len(running) > 1:
        choices = "; ".join(f"{other.name}: {other.command_for(verb)}" for other in running)
        raise ConfigError(f"{len(running)} instances run, name one with -c: {choices}")
    if running:
        return load_config(running[0].config or None), running[0]
    return config, None


def stop_instance(instance: Instance, timeout_s: float) -> bool:
    """SIGTERM to the `start` or `demo` process (which stops the job with a final savepoint, the
    bridge and its local broker); True once it has exited."""
    os.kill(instance.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_alive(instance.pid):
            return True
        time.sleep(0.2)
    return False


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
    mistake is one line and leaves nothing running: the files, the model against the config, Java,
    the ports the job and the bridge listen on, and the broker (a running one, or what starting the
    local one needs)."""
    config.check_files()
    model_signature(config)
    find_java()
    check_port("flink.rest_port", "127.0.0.1", config.flink.rest_port)
    if http:
        check_port("http.port", config.http.host, config.http.port)
    if not local_broker:
        if not broker_reachable(config.kafka.bootstrap_servers):
            raise unreachable(config.kafka.bootstrap_servers)
    elif broker_to_start(config):
        kafka_version()  # the broker's jars are there
    elif not kafka_answers(config.kafka.bootstrap_servers):
        host, port = broker_address(config)
        holder = listener_of(port) or "a process"
        raise ConfigError(
            f"kafka.bootstrap_servers: {host}:{port} is in use by {holder}, which is not a Kafka broker; "
            "stop it or set another port"
        )


def check_port(key: str, host: str, port: int) -> None:
    """A port the job or the bridge will listen on must be free now (0: any free port)."""
    if port and port_taken(host, port):
        holder = listener_of(port)
        raise ConfigError(f"{key}: {host}:{port} is in use{f' by {holder}' if holder else ''}; stop it or set another {key}")


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
    if not broker_reachable(kafka.bootstrap_servers):
        return {"broker": f"not reachable at {kafka.bootstrap_servers}"}
    properties = client_properties(kafka)
    topics = [kafka.input_topic, kafka.result_topic]
    before = records_written(kafka.bootstrap_servers, topics, **properties)
    started = time.monotonic()
    time.sleep(RATE_SAMPLE_S)
    after = records_written(kafka.bootstrap_servers, topics, **properties)
    elapsed = time.monotonic() - started
    committed = consumer_lag(kafka.bootstrap_servers, kafka.input_topic, kafka.group_id, **properties)
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
        others = "; ".join(f"{other.name}: {other.command_for('status')}" for other in live_instances())
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
