"""A local standalone Flink cluster (one JobManager, N TaskManagers) run from the pip-installed
PyFlink, for submitting the serving job with `flink run -py` as one would to a real cluster:
`cluster-serving cluster up | submit | status | down`.

Everything the cluster writes lives in its folder: conf/ (config.yaml bound to 127.0.0.1, the
log4j files, the workers), log/, pid/ and lib/. PyFlink's own directories are only read.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyflink
import yaml

from cluster_serving.config import ConfigError
from cluster_serving.jvm import connector_jar
from cluster_serving.net.flink_rest import FlinkRest, FlinkRestError
from cluster_serving.ops.processes import free_port, pids_naming

log = logging.getLogger(__name__)

PYFLINK_HOME = Path(pyflink.__file__).resolve().parent
# What `flink run -py` runs: the job module of this installed package.
JOB_SCRIPT = Path(__file__).resolve().parents[1] / "job" / "main.py"
VENV_BIN = str(Path(sys.executable).parent)
JOB_ID_PATTERN = re.compile(r"JobID ([0-9a-f]{32})|job ([0-9a-f]{32}) submitted")
# job/main.py's resume_point line: where the submitted job starts.
START_PATTERN = re.compile(r"resuming from the retained \S+ \S+|starting from the committed offsets of group \S+")


def cluster_config(rest_port: int, rpc_port: int, work_dir: Path, task_slots: int) -> dict:
    """The cluster's config.yaml: loopback only, and memory sizes that leave room for the broker,
    the test clients and other JVMs on a 2-core machine."""
    return {
        "env": {
            "java": {"opts": {"all": _pyflink_default("env.java.opts.all")}},
            "log": {"dir": str(work_dir / "log")},
            "pid": {"dir": str(work_dir / "pid")},
        },
        "jobmanager": {
            "rpc": {"address": "127.0.0.1", "port": rpc_port},
            "bind-host": "127.0.0.1",
            "memory": {"process": {"size": "1024m"}},
            "execution": {"failover-strategy": "region"},
        },
        "taskmanager": {
            "bind-host": "127.0.0.1",
            "host": "127.0.0.1",
            "numberOfTaskSlots": task_slots,
            "memory": {"process": {"size": "1728m"}},
            # A job's subtasks over every TaskManager rather than filling one first: losing one
            # TaskManager then costs a share of the job, not all of it.
            "load-balance": {"mode": "SLOTS"},
        },
        "rest": {"address": "127.0.0.1", "bind-address": "127.0.0.1", "port": rest_port},
        "parallelism": {"default": 1},
    }


def _pyflink_default(flat_key: str) -> str:
    """A value of PyFlink's shipped config.yaml (the JDK 17 --add-opens list, which Flink needs)."""
    value: object = yaml.safe_load((PYFLINK_HOME / "conf" / "config.yaml").read_text())
    for part in flat_key.split("."):
        value = value[part]  # type: ignore[index]
    return str(value)


class StandaloneCluster:
    """`start-cluster.sh` / `stop-cluster.sh` of the pip-installed PyFlink with a private
    FLINK_CONF_DIR and FLINK_LIB_DIR, plus `flink run -py` submission of the serving job; `rest`
    asks its JobManager (wait for a job, cancel it)."""

    def __init__(self, rest_port: int, work_dir: Path, task_slots: int = 2, rpc_port: int = 0, taskmanagers: int = 1):
        self.rest_port = rest_port
        self.work_dir = Path(work_dir).resolve()
        self.task_slots = task_slots
        self.taskmanagers = taskmanagers
        self.rpc_port = rpc_port  # 0: a free port, chosen when conf/ is written
        self.conf_dir = self.work_dir / "conf"
        self.lib_dir = self.work_dir / "lib"
        self.log_dir = self.work_dir / "log"
        self.pid_dir = self.work_dir / "pid"
        self.rest = FlinkRest(f"http://127.0.0.1:{rest_port}")

    @classmethod
    def of_folder(cls, work_dir: Path) -> StandaloneCluster:
        """The cluster whose conf/ a former `up` wrote in `work_dir`."""
        conf = Path(work_dir) / "conf" / "config.yaml"
        if not conf.is_file():
            raise ConfigError(f"no Flink cluster in {work_dir} (no conf/config.yaml); start one: cluster-serving cluster up --dir {work_dir}")
        settings = yaml.safe_load(conf.read_text())
        return cls(settings["rest"]["port"], work_dir, settings["taskmanager"]["numberOfTaskSlots"], settings["jobmanager"]["rpc"]["port"])

    @property
    def web_ui(self) -> str:
        return self.rest.url

    def prepare(self) -> None:
        """Writes conf/ and lib/. lib/ is PyFlink's lib/ plus opt/flink-python and Flink's Kafka
        connector, all loaded by the TaskManager's own class loader, once per JVM. flink-python:
        pemja's native library can be loaded once per JVM only; loaded per job (from the job's
        jars) a second thread-mode job fails with `NoSuchFieldException: loadedLibraryNames` on
        JDK 17. The connector: a job submitted again (a restart, an upgrade) runs on the Kafka
        client code the JIT compiled for the jobs before it, instead of a fresh copy of its classes
        to compile again (docs/benchmarks.md, "A job restarted on a running cluster"). Its classes,
        under org.apache.flink, are among those Flink always loads parent-first, so the copy a job
        ships is not loaded."""
        for directory in (self.conf_dir, self.lib_dir, self.log_dir, self.pid_dir):
            directory.mkdir(parents=True, exist_ok=True)
        for source in PYFLINK_HOME.joinpath("conf").glob("log4j*.properties"):
            shutil.copy(source, self.conf_dir / source.name)
        rpc_port = self.rpc_port or free_port()
        config = cluster_config(self.rest_port, rpc_port, self.work_dir, self.task_slots)
        (self.conf_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        (self.conf_dir / "workers").write_text("127.0.0.1\n" * self.taskmanagers)
        (self.conf_dir / "masters").write_text(f"127.0.0.1:{self.rest_port}\n")
        jars = [*PYFLINK_HOME.joinpath("lib").glob("*.jar"), *PYFLINK_HOME.joinpath("opt").glob("flink-python-*.jar"), connector_jar()]
        for old in self.lib_dir.glob("*.jar"):
            old.unlink()
        for jar in jars:
            (self.lib_dir / jar.name).symlink_to(jar)

    def variables(self) -> dict[str, str]:
        """What PyFlink's bin/ scripts need to use this cluster's directories."""
        return {
            "FLINK_CONF_DIR": str(self.conf_dir),
            "FLINK_LIB_DIR": str(self.lib_dir),
            "FLINK_LOG_DIR": str(self.log_dir),
            "FLINK_PID_DIR": str(self.pid_dir),
        }

    def environment(self) -> dict[str, str]:
        """The environment of the cluster scripts and the CLI. The venv's bin comes first on PATH:
        thread mode embeds the `python` found there into the TaskManager JVM (pemja)."""
        env = {**os.environ, **self.variables()}
        env["PATH"] = os.pathsep.join([VENV_BIN, env.get("PATH", "")])
        return env

    def _script(self, name: str, *args: str, timeout: float = 120.0) -> tuple[int, str]:
        """Runs one of PyFlink's bin/ scripts; returns its exit code and output. It runs in its own
        session so that a timeout also ends what it started (the CLI's Python client)."""
        process = subprocess.Popen(
            [str(PYFLINK_HOME / "bin" / name), *args],
            env=self.environment(), cwd=self.work_dir, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            raise RuntimeError(f"{name} did not return in {timeout:.0f} s:\n{output}") from None
        return process.returncode, output

    def start(self, timeout: float = 90.0) -> None:
        """Starts the JobManager and the TaskManagers; returns once they all registered."""
        if self.processes():
            raise ConfigError(f"a Flink cluster already runs from {self.work_dir}; stop it first: cluster-serving cluster down --dir {self.work_dir}")
        self.prepare()
        started = time.monotonic()
        try:
            code, output = self._script("start-cluster.sh", timeout=timeout)
            if code != 0:
                raise RuntimeError(f"start-cluster.sh failed ({code}):\n{output}")
            self._wait_for_taskmanager(started + timeout)
        except BaseException:
            self.stop()
            raise
        log.info("Flink cluster up in %.1f s: %s (logs in %s)", time.monotonic() - started, self.web_ui, self.log_dir)

    def _wait_for_taskmanager(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            try:
                if self.rest.taskmanagers() >= self.taskmanagers:
                    return
            except FlinkRestError:
                pass
            if not self.processes():
                raise RuntimeError(f"the Flink cluster exited:\n{self.log_tail()}")
            time.sleep(0.5)
        raise RuntimeError(f"no TaskManager registered at {self.web_ui} in time:\n{self.log_tail()}")

    def processes(self) -> list[int]:
        """Pids of this cluster's live JVMs (daemons and CLI), found by the conf dir on their command
        line: unlike pid files, this also finds a daemon whose start or stop was cut short."""
        return pids_naming(self.conf_dir)

    def log_tail(self, lines: int = 40) -> str:
        """The end of every daemon log: where a cluster that does not come up says why."""
        tails = []
        for path in sorted(self.log_dir.glob("flink-*.log")) + sorted(self.log_dir.glob("flink-*.out")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            tails.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(tails)

    def submit(self, config_path: Path, timeout: float = 180.0) -> tuple[str, str]:
        """`flink run --detached -py cluster_serving/job/main.py`; returns the job id and where the
        job starts, as its own log line in the CLI's output says (a retained checkpoint or final
        savepoint, or the group's committed offsets). The CLI returns once the job is submitted."""
        python = sys.executable
        code, output = self._script(
            "flink", "run", "--detached",
            "-py", str(JOB_SCRIPT), "-pyexec", python, "-pyclientexec", python,
            "--", "--config", str(Path(config_path).resolve()),
            timeout=timeout,
        )
        match = JOB_ID_PATTERN.search(output)
        if code != 0 or match is None:
            raise RuntimeError(f"flink run failed ({code}): {_last_error(output)}")
        job_id = match.group(1) or match.group(2)
        log.info("job %s submitted to %s", job_id, self.web_ui)
        start = START_PATTERN.search(output)
        return job_id, start.group(0) if start else "start point not logged"

    def stop(self, timeout: float = 30.0) -> None:
        """stop-cluster.sh, then SIGKILL for any of the cluster's JVMs still there; idempotent."""
        if not self.processes():
            return
        try:
            self._script("stop-cluster.sh", timeout=timeout)
        except RuntimeError as exc:
            log.warning("%s", exc)
        deadline = time.monotonic() + timeout
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in self.processes():
            log.warning("Flink process %d still running after stop-cluster.sh: killing it", pid)
            os.kill(pid, signal.SIGKILL)


def _last_error(output: str) -> str:
    """The line of `flink run`'s output that says what failed: the job's own `error:` line when
    its start-up checks refused, else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or ["no output"])[-1].removeprefix("error: ")
