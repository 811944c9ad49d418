"""The Flink REST API as the CLI, the HTTP bridge, the docker `submit` service and the tests ask it:
is a TaskManager there, which job of a name runs, wait for a job to run, cancel or stop one.

urllib is enough for these few JSON calls, so the bridge and the docker image carry no HTTP
client library for them.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

# States a job does not leave: waiting for it to run, or to end, can stop there.
TERMINAL_STATES = ("FINISHED", "FAILED", "CANCELED")
POLL_S = 0.3


class FlinkRestError(OSError):
    """The REST API did not answer, or not with JSON. An OSError, as the network failure under it
    is, so callers that treat any connection failure alike need not name it."""


class FlinkRest:
    """A JobManager's REST API at `url` (http://host:port, the web UI's address)."""

    def __init__(self, url: str, timeout_s: float = 5.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def get(self, path: str) -> Any:
        """GET `path` (e.g. "/overview"); a dict, or a list for metric queries."""
        return self._call("GET", path)

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {} if body is None else {"Content-Type": "application/json"}
        request = urllib.request.Request(f"{self.url}{path}", data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                answer = response.read()
        except urllib.error.HTTPError as exc:
            raise FlinkRestError(
                f"Flink REST API at {self.url} answered {method} {path} with {exc.code} ({exc.reason})"
            ) from exc
        except OSError as exc:
            raise FlinkRestError(f"Flink REST API not reachable at {self.url} ({exc})") from exc
        try:
            return json.loads(answer) if answer else {}
        except ValueError as exc:
            raise FlinkRestError(
                f"Flink REST API at {self.url} answered {method} {path} with no JSON ({exc})"
            ) from exc

    def taskmanagers(self) -> int:
        """How many TaskManagers have registered: a job waits for slots until one has."""
        return int(self.get("/overview").get("taskmanagers", 0))

    def jobs(self) -> list[dict[str, Any]]:
        """Every job the cluster knows, in any state (name, jid, state, start-time, duration)."""
        return list(self.get("/jobs/overview").get("jobs", []))

    def job(self, job_id: str) -> dict[str, Any]:
        """One job's details: its vertices (name, parallelism, metrics). The REST API answers them
        from a copy it keeps for web.refresh-interval (Flink's default 3 s): for states as they
        are now, ask overview() or state()."""
        return self.get(f"/jobs/{job_id}")

    def overview(self, job_id: str) -> dict[str, Any] | None:
        """The job's line of /jobs/overview, as it is now: its state, and how many of its tasks
        are in each state; None while the cluster does not know the job."""
        return next((job for job in self.jobs() if job.get("jid") == job_id), None)

    def state(self, job_id: str) -> str | None:
        """The job's state now (RUNNING, FINISHED, ...), None while the cluster does not know it."""
        job = self.overview(job_id)
        return job and job["state"]

    def find_job(self, name: str) -> dict[str, Any] | str:
        """The running (else the newest) job called `name`, or a sentence saying why there is none:
        status lines and readiness answers show it as it is."""
        try:
            jobs = [job for job in self.jobs() if job.get("name") == name]
        except FlinkRestError as exc:
            return str(exc)
        if not jobs:
            return f"no {name!r} job on {self.url}"
        running = [job for job in jobs if job["state"] == "RUNNING"]
        return max(running or jobs, key=lambda job: job["start-time"])

    def wait_until_running(self, job_id: str, timeout_s: float) -> None:
        """Returns once the job and all its vertices run: a job reported RUNNING may still be
        deploying its tasks. Raises RuntimeError when it ends first or the time is up; until the
        job is known (or the API answers) it keeps asking."""
        deadline = time.monotonic() + timeout_s
        state = "unknown"
        while time.monotonic() < deadline:
            try:
                job = self.overview(job_id)
            except FlinkRestError:
                job = None
            if job is not None:
                state, tasks = job["state"], job["tasks"]
                if state in TERMINAL_STATES:
                    raise RuntimeError(f"job {job_id} is {state}")
                if state == "RUNNING" and tasks["running"] == tasks["total"]:
                    return
            time.sleep(POLL_S)
        raise RuntimeError(f"job {job_id} not running after {timeout_s:.0f} s (state {state})")

    def cancel(self, job_id: str, timeout_s: float = 30.0) -> None:
        """Cancels the job (what the web UI's Cancel button does; no savepoint) and returns once
        it has ended."""
        self._call("PATCH", f"/jobs/{job_id}?mode=cancel")
        self._wait_until_ended(job_id, time.monotonic() + timeout_s)

    def _wait_until_ended(self, job_id: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.state(job_id) in TERMINAL_STATES:
                return
            time.sleep(POLL_S)
        raise RuntimeError(f"job {job_id} has not ended in time")

    def stop_with_savepoint(self, job_id: str, target: str, timeout_s: float = 120.0) -> str:
        """Stops the job with a final savepoint into the folder `target` (a URI; what `flink stop
        --savepointPath` does) and returns the savepoint's location once the job has ended.
        Raises RuntimeError when the savepoint fails (the job then runs on) or the time is up."""
        trigger = self._call("POST", f"/jobs/{job_id}/stop", {"targetDirectory": target, "drain": False})["request-id"]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            answer = self.get(f"/jobs/{job_id}/savepoints/{trigger}")
            if answer["status"]["id"] == "COMPLETED":
                operation = answer.get("operation", {})
                if "failure-cause" in operation:
                    cause = operation["failure-cause"].get("stack-trace", "").splitlines()[:1]
                    raise RuntimeError(f"job {job_id}: no savepoint ({cause[0] if cause else 'see the Flink log'})")
                self._wait_until_ended(job_id, deadline)
                return operation["location"]
            time.sleep(POLL_S)
        raise RuntimeError(f"job {job_id}: no savepoint after {timeout_s:.0f} s")
