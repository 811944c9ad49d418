"""Child processes the CLI, the demo and the tests start: the local Kafka broker, the embedded job
and the HTTP bridge, and `supervise`, which runs them for `cluster-serving start`.

Each runs in its own process group, so stopping it also stops what it started (the embedded
job's JVM), and a test that fails still leaves nothing behind.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from cluster_serving.config import RESTART_SIGNAL, ConfigError, load_config
from cluster_serving.http import READY_LINE
from cluster_serving.net.flink_rest import FlinkRest
from cluster_serving.ops.broker_security import BrokerSecurity
from cluster_serving.ops.local_broker import READY_PREFIX
from cluster_serving.ops.processes import python_module_command


class ChildFailed(RuntimeError):
    """A child that exited or did not get ready: `summary` is one line for users; the message adds
    the tail of the child's log, for tests and the benchmark."""

    def __init__(self, summary: str, log_tail: str):
        super().__init__(f"{summary}:\n{log_tail}")
        self.summary = summary


class ChildProcess:
    """`python -m <module> <args>` in a process group of its own, its output in a log file (ready
    when a line there matches) or, with `inherit_output`, on this process's stdout and stderr for
    a user to watch."""

    module: str = ""
    ready_pattern: re.Pattern[str] = re.compile(r"$^")
    stop_signal = signal.SIGTERM

    def __init__(self, args: list[str], log_path: str | Path | None = None, *, inherit_output: bool = False):
        self.args = args
        self.inherit_output = inherit_output
        self.log_path = Path(log_path) if log_path else None
        self._owns_log = log_path is None and not inherit_output
        self.process: subprocess.Popen[bytes] | None = None
        self.ready: re.Match[str] | None = None

    def spawn(self) -> None:
        """Starts the child without waiting for it to be ready. Its own session makes it the
        leader of a new process group, which stop() ends as a whole; a Ctrl-C at the terminal
        therefore reaches only us, and stop() sends each child its own stop signal once."""
        if self._owns_log and self.log_path is None:
            handle, name = tempfile.mkstemp(prefix=f"{self.module}-", suffix=".log")
            os.close(handle)
            self.log_path = Path(name)
        command, env = python_module_command(self.module, *self.args)
        if self.log_path is None:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
            return
        with open(self.log_path, "wb") as log_file:
            self.process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                env=env, start_new_session=True,
            )

    def start(self, timeout: float = 60.0) -> ChildProcess:
        """Spawns the child and waits for its ready line (kept in `ready`); errors carry the log tail."""
        if self.inherit_output:
            raise ValueError(f"{self.module}: its output goes to the terminal, there is no ready line to wait for")
        self.spawn()
        try:
            self.ready = self._wait_for_line(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_for_line(self, timeout: float) -> re.Match[str]:
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = self.ready_pattern.search(self.log_text())
            if match:
                return match
            if self.process.poll() is not None:
                raise self._failed(f"exited with {self.process.returncode}")
            time.sleep(0.1)
        raise self._failed(f"not ready after {timeout:.0f} s")

    def _failed(self, what: str) -> ChildFailed:
        """The child's own `error:` line, when it wrote one, says why; a log of our choosing is
        named (a temporary one is gone by the time a user reads the line)."""
        reason = next((line[len("error: "):] for line in reversed(self.log_text().splitlines())
                       if line.startswith("error: ")), "")
        where = "" if self._owns_log else f" (log: {self.log_path})"
        return ChildFailed(f"{self.module} {what}{': ' + reason if reason else ''}{where}", self.log_tail())

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 20.0) -> int | None:
        """Asks the child to stop, then kills its whole group (with the JVM it started); idempotent.
        Returns its exit code, None when it was not started or already stopped."""
        process, self.process = self.process, None
        if process is None:
            return None
        _signal_group(process.pid, self.stop_signal)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(process.pid, signal.SIGKILL)
        code = process.wait()
        if self._owns_log and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
            self.log_path = None
        return code

    def kill(self) -> None:
        """SIGKILL to the whole group at once: a crash, not a stop (nothing gets to clean up)."""
        process, self.process = self.process, None
        if process is not None:
            _signal_group(process.pid, signal.SIGKILL)
            process.wait()

    def __enter__(self) -> ChildProcess:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def supervise(children: Sequence[ChildProcess], started: Callable[[], None], stop_timeout: float = 120.0,
              restart_on: signal.Signals | None = None) -> int:
    """Spawns the children, calls `started`, then waits until one of them ends or Ctrl-C (or a
    signal handler's KeyboardInterrupt) arrives, and stops them all, the last spawned first: one
    child without the other serves nothing. Returns the highest exit code. The stop timeout is
    long enough for the job's final savepoint; after it a child's group is killed. The signal
    `restart_on` restarts the embedded job among them (EmbeddedJob.restart), the others serving on."""
    codes: list[int | None] = []
    asked: list[int] = []
    if restart_on is not None:
        signal.signal(restart_on, lambda signum, frame: asked.append(signum))
    try:
        for child in children:
            child.spawn()
        started()
        while all(child.running for child in children):
            if asked:
                asked.clear()
                for child in children:
                    if isinstance(child, EmbeddedJob):
                        print("restarting the job: a final savepoint, then the job again from it", flush=True)
                        child.restart(stop_timeout)
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        codes = [child.stop(stop_timeout) for child in reversed(children)]
    return max(code or 0 for code in codes)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


class LocalBroker(ChildProcess):
    """The local Apache Kafka broker (`python -m cluster_serving.ops.local_broker`), its data in `data`."""

    module = "cluster_serving.ops.local_broker"
    ready_pattern = re.compile(re.escape(READY_PREFIX) + r"(?P<address>\S+) in (?P<seconds>[0-9.]+) s")

    def __init__(
        self,
        data: str | Path,
        port: int = 0,
        topics: dict[str, int] | None = None,
        log_path: str | Path | None = None,
        fresh: bool = False,
        secure_for: str | None = None,
    ):
        """`secure_for`: a secured broker (TLS, SCRAM users, ACLs) whose user `requester` may write that topic."""
        topic_args = [arg for name, count in (topics or {}).items() for arg in ("--topic", f"{name}:{count}")]
        fresh_args = ["--fresh"] if fresh else []
        secure_args = ["--secure", "--request-topic", secure_for] if secure_for else []
        super().__init__(["--port", str(port), "--data", str(data), *fresh_args, *topic_args, *secure_args], log_path)
        self.data = Path(data)
        self.bootstrap_servers = ""

    def start(self, timeout: float = 90.0) -> LocalBroker:
        super().start(timeout)
        self.bootstrap_servers = self.ready["address"]
        return self

    def client_properties(self, user: str = "serving") -> dict[str, str]:
        """A secured broker's kafka.properties for `user` (admin, serving or requester)."""
        return BrokerSecurity.of(self.data.resolve()).client_properties(user)

    @property
    def ready_seconds(self) -> float:
        """How long the broker took from the command to serving clients, as it printed."""
        return float(self.ready["seconds"]) if self.ready else float("nan")


def _config_args(config_path: str | Path | None) -> list[str]:
    """No --config: the child reads cluster_serving/config/config.yaml with the working folder as its base."""
    return ["--config", str(config_path)] if config_path else []


class HttpBridge(ChildProcess):
    """The HTTP cluster_serving.http (`python -m cluster_serving.http.server --config ...`); `url` once it is ready."""

    module = "cluster_serving.http.server"
    ready_pattern = re.compile(re.escape(READY_LINE) + r"(?P<url>\S+)")

    def __init__(self, config_path: str | Path | None, log_path: str | Path | None = None, *, inherit_output: bool = False):
        super().__init__(_config_args(config_path), log_path, inherit_output=inherit_output)
        self.url = ""

    def start(self, timeout: float = 30.0) -> HttpBridge:
        super().start(timeout)
        self.url = self.ready["url"]
        return self


class EmbeddedJob(ChildProcess):
    """The serving cluster_serving.job on an embedded Flink MiniCluster (`python -m cluster_serving.job.main --config ...`)."""

    module = "cluster_serving.job.main"
    ready_pattern = re.compile(r"job (?P<job_id>[0-9a-f]{32}) submitted")
    # SIGINT lets job.main stop the Flink job with a final savepoint and shut the MiniCluster down.
    stop_signal = signal.SIGINT

    def __init__(
        self,
        config_path: str | Path | None,
        rest_port: int,
        log_path: str | Path | None = None,
        fresh: bool = False,
        *,
        inherit_output: bool = False,
    ):
        args = [*_config_args(config_path), *(["--fresh"] if fresh else [])]
        super().__init__(args, log_path, inherit_output=inherit_output)
        self.config_path = config_path
        self.rest_port = rest_port
        self.flink = FlinkRest(f"http://127.0.0.1:{rest_port}")
        self.job_id = ""
        self.jvm_options: tuple[str, ...] | None = None

    def start(self, timeout: float = 120.0) -> EmbeddedJob:
        """Returns once every task of the job is RUNNING."""
        deadline = time.monotonic() + timeout
        super().start(timeout)
        self.job_id = self.ready["job_id"]
        try:
            self.flink.wait_until_running(self.job_id, deadline - time.monotonic())
        except BaseException:
            self.stop()
            raise
        return self

    def spawn(self) -> None:
        self.jvm_options = self._jvm_options()
        super().spawn()

    def restart(self, timeout: float = 120.0) -> None:
        """Restarts the job from a final savepoint with the config file as it reads now (a new
        flink.parallelism, say), the job process in its own JVM, on the code the JIT compiled for
        the job before. New flink.jvm_options need a new JVM: the process is stopped and spawned
        again (never fresh). With a log, returns once every task of the new job runs."""
        assert self.process is not None
        if self._jvm_options() != self.jvm_options:
            self.stop(timeout)
            self.args = _config_args(self.config_path)
            if self.inherit_output:
                self.spawn()
            else:
                self.start(timeout)
            return
        submitted = len(self.ready_pattern.findall(self.log_text()))
        os.kill(self.process.pid, RESTART_SIGNAL)  # the Python process alone: not its JVM
        if self.inherit_output:
            return
        deadline = time.monotonic() + timeout
        while len(matches := self.ready_pattern.findall(self.log_text())) == submitted:
            if not self.running or time.monotonic() > deadline:
                raise self._failed("did not submit its job again" if self.running else "ended while restarting its job")
            time.sleep(0.1)
        self.job_id = matches[-1]
        self.flink.wait_until_running(self.job_id, deadline - time.monotonic())

    def _jvm_options(self) -> tuple[str, ...] | None:
        """flink.jvm_options as the config file reads now; None when it cannot be read (the job
        process says why when it restarts)."""
        try:
            return load_config(self.config_path).flink.jvm_options
        except ConfigError:
            return None

    @property
    def web_ui(self) -> str:
        return self.flink.url

    def rest(self, path: str) -> Any:
        """GET on the job's Flink REST API, e.g. rest(f"/jobs/{job.job_id}")."""
        return self.flink.get(path)
