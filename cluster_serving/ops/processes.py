"""The process toolkit: what is asked about processes (alive, group members, memory, command
lines, who listens on a port) is asked here, of psutil, rather than by parsing /proc in each place
that needs it; and free ports and one-run configs for the demo, the tests and the bench. The
children themselves (broker, job, bridge) are cluster_serving/ops/children.py's.
"""

from __future__ import annotations

import functools
import os
import random
import socket
import sys
import uuid
from pathlib import Path
from typing import Any

import psutil
import yaml

# The folder that holds this cluster_serving package (site-packages, or a clone): children import
# from it, whatever folder they run in.
PACKAGE_HOME = Path(__file__).resolve().parents[2]


def python_module_command(module: str, *args: str) -> tuple[list[str], dict[str, str]]:
    """The command and environment that run `python -m module` with this Python and this package:
    `-P` keeps the working folder off the path, so a folder of the user's own named like one of
    ours cannot stand in for it."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_HOME), env.get("PYTHONPATH")]))
    return [sys.executable, "-P", "-m", module, *args], env


def pid_alive(pid: int) -> bool:
    """True while the process runs. An exited one that its parent has not reaped yet (a zombie)
    is not: the processes asked about (a `cluster-serving start`, Flink's daemons) are not our
    children, so we cannot reap them, and their parent may do so late."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False


def process_group_members(pgid: int) -> set[int]:
    """The pids of a process group, e.g. a child started here and the JVM it started."""
    members = set()
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) == pgid:
                members.add(pid)
        except OSError:  # gone since it was listed
            continue
    return members


def group_rss_mb(pgid: int) -> float:
    """Resident memory of every process in the group (the job's Python and its Flink JVM)."""
    total = 0
    for pid in process_group_members(pgid):
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            continue
    return total / 2**20


def pids_naming(directory: Path) -> list[int]:
    """Live processes other than this one with `directory`, or a path inside it, on their command
    line: this finds a daemon that a script started (not our child) even when its pid file was
    never written or already removed."""
    inside = f"{directory}/"
    pids = []
    for process in psutil.process_iter(["cmdline"]):
        args = process.info["cmdline"] or []
        if (process.pid != os.getpid() and any(arg == str(directory) or inside in arg for arg in args)
                and pid_alive(process.pid)):
            pids.append(process.pid)
    return pids


def listener_of(port: int) -> str:
    """Who listens on a TCP port, as an error line names it: `pid 4242 (python -m cluster_serving.job.main
    --config ...)`; "" when nothing does or its owner cannot be seen (another user's process)."""
    try:
        connections = psutil.net_connections(kind="tcp")
    except psutil.Error:
        return ""
    for connection in connections:
        if connection.status == psutil.CONN_LISTEN and connection.laddr.port == port and connection.pid:
            try:
                command = " ".join(" ".join(psutil.Process(connection.pid).cmdline()).split())  # one line
            except psutil.Error:
                command = "?"
            shown = command if len(command) <= 100 else command[:97] + "..."
            return f"pid {connection.pid} ({shown})"
    return ""


_PORTS_HANDED_OUT: set[int] = set()


@functools.cache
def _ephemeral_ports_start() -> int:
    """The kernel's ephemeral range, which psutil does not report: /proc it is, read once."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now and that no other process will be
    handed by the kernel later. The port is chosen below the ephemeral range: a port from the
    ephemeral range is free only until some outgoing connection (a Kafka client, Flink's own
    RPC) is given it, which made a bridge started seconds later fail with "Address already in
    use". Ports are not handed out twice by one process."""
    low = _ephemeral_ports_start()
    candidates = list(range(20000, low)) if low > 21000 else []
    random.shuffle(candidates)
    for port in candidates:
        if port in _PORTS_HANDED_OUT:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_HANDED_OUT.add(port)
        return port
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def write_run_config(folder: Path, model_path: Path, bootstrap: str, **sections: Any) -> Path:
    """A config file of its own for one run: fresh topic names, group id, REST and HTTP ports, so
    runs sharing a broker never see each other's records. `sections` override, e.g. batching={...}."""
    run_id = uuid.uuid4().hex[:8]
    raw: dict[str, Any] = {
        "model": {"path": str(model_path)},
        "kafka": {
            "bootstrap_servers": bootstrap,
            "input_topic": f"requests-{run_id}",
            "result_topic": f"results-{run_id}",
            "group_id": f"serving-{run_id}",
        },
        "flink": {"rest_port": free_port()},
        "http": {"port": free_port()},
    }
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values} if isinstance(values, dict) else values
    path = folder / f"config-{run_id}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path
