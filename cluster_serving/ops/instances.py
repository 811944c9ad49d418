"""The records of running instances: what a `cluster-serving start` or `demo` uses (ports, the input
topic's consumer group, the Flink log and checkpoint folders), kept in `.cluster-serving.json` next
to its config and locked with flock for the process's life: the kernel drops the lock when the
process ends, however it ends, so a record that nobody holds is stale. A link in a per-user folder
(`registry()`) points at each record, so that a new instance, `status` and `stop` also find the
instances of other folders.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from cluster_serving.config import ConfigError, ServingConfig, load_config
from cluster_serving.ops.processes import pid_alive

RECORD_FILE = ".cluster-serving.json"
# The folder of links to live instances' records; the tests give it a folder of their own.
REGISTRY_ENV = "CLUSTER_SERVING_RUN_DIR"

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

    def ports_moved(self, config: ServingConfig) -> list[str]:
        """The ports this instance listens on that `config` would have it listen on elsewhere."""
        now = Instance.of(self.command, config, "http.port" in self.ports, self.ports.get("its local broker")).ports
        return [f"{role} {port} -> {now[role]}" for role, port in self.ports.items() if now.get(role) != port]

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


def commands_for(verb: str, instances: list[Instance] | None = None) -> str:
    """`name: cluster-serving VERB -c CONFIG` for each (by default every live) instance, as error
    and status lines list them; "" for none."""
    running = live_instances() if instances is None else instances
    return "; ".join(f"{other.name}: {other.command_for(verb)}" for other in running)


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
        raise ConfigError(f"{len(running)} instances run, name one with -c: {commands_for(verb, running)}")
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
