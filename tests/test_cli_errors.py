"""Every mistake a user can make with `cluster-serving` (and with the job and the bridge run alone)
ends in one `error: ...` line on stderr and exit code 2, within seconds, before anything starts,
and leaves no process behind. One row per mistake.

A running instance in the way is a holder process that claims an instance's record exactly as
`start` and `demo` do (ops.operations.claim) and then sleeps: what a second start must refuse is
the record and what it says, not a Flink job, so the rows need none (test_cli_start runs the real
thing). The rows share the session's local broker, so that each config is valid but for its row's
mistake, and a registry folder of their own (CLUSTER_SERVING_RUN_DIR), so that instances of other
work on this machine do not count.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from cluster_serving.config import load_config
from cluster_serving.kafka.admin import NOT_KAFKA, NOTHING_LISTENS, broker_problem
from cluster_serving.ops.children import LocalBroker
from cluster_serving.ops.cli import init_folder
from cluster_serving.ops.instances import REGISTRY_ENV
from cluster_serving.ops.processes import free_port, pids_naming, write_run_config
from tests.paths import PROJECT_ROOT

# A bound on a hang, not a speed benchmark: every cause below is local (a probe of a dead address
# included); the rows take about 1 s each, 3 s where a listener is asked whether it speaks Kafka.
LOCAL_S = 10.0
CLI = ("-m", "cluster_serving.ops.cli")
HOLDER = """
import sys, time
from cluster_serving.config import load_config
from cluster_serving.ops.instances import Instance, claim
broker_port = int(sys.argv[3]) if len(sys.argv) > 3 else None
claim(Instance.of(sys.argv[2], load_config(sys.argv[1]), http=True, broker_port=broker_port))
print("held", flush=True)
time.sleep(600)
"""


class Scene:
    """One row's world: configs in folders of its own, ports held by listeners, running instances
    (holders), and the values its command line names ({config}, {other}, {folder}, {data})."""

    def __init__(self, tmp_path: Path, broker: LocalBroker, sample_model: Path):
        self.tmp, self.broker, self.sample_model = tmp_path, broker, sample_model
        # No FLINK_LOG_DIR from outside: it would give every instance the same log folder.
        self.env = {key: value for key, value in os.environ.items() if key != "FLINK_LOG_DIR"}
        self.env[REGISTRY_ENV] = str(tmp_path / "registry")
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))
        self.values: dict[str, str] = {"data": str(tmp_path / "kafka")}
        self.holders: list[subprocess.Popen[str]] = []
        self.listeners: list[socket.socket] = []

    def config(self, folder: str = "a", **sections: dict) -> Path:
        """A valid config (its own topics, group and ports, the shared broker) but for `sections`."""
        (self.tmp / folder).mkdir(exist_ok=True)
        return write_run_config(self.tmp / folder, self.sample_model, self.broker.bootstrap_servers, **sections)

    def copy(self, path: Path, folder: str, **changes: dict) -> Path:
        """The config at `path`, as a file in another folder, with some sections changed."""
        raw = yaml.safe_load(path.read_text())
        for section, values in changes.items():
            raw[section] = {**raw.get(section, {}), **values}
        (self.tmp / folder).mkdir(exist_ok=True)
        copied = self.tmp / folder / path.name
        copied.write_text(yaml.safe_dump(raw))
        return copied

    def listen(self) -> int:
        """A port that something else (not Kafka) listens on."""
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", free_port()))
        listener.listen()
        self.listeners.append(listener)
        return listener.getsockname()[1]

    def hold(self, path: Path, command: str = "start", *broker_port: int) -> None:
        """A live instance of `path`, as `start` or `demo` records one (with its local broker's port)."""
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), command, *map(str, broker_port)],
                                  cwd=self.tmp, env=self.env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.holders.append(holder)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held", holder.stdout.read()

    def use(self, **values: Path | int | str) -> None:
        self.values.update({key: str(value) for key, value in values.items()})

    def close(self) -> None:
        for holder in self.holders:
            holder.kill()
            holder.wait()
        for listener in self.listeners:
            listener.close()


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]  # after the Python executable; {name} is a Scene value
    expected: str  # a fragment of the error line
    setup: Callable[[Scene], None] = lambda scene: None
    no_java: bool = False


def bad_value(scene: Scene) -> None:
    scene.use(config=scene.config(batching={"batch_size": 0}))


def missing_model(scene: Scene) -> None:
    scene.use(config=scene.config(model={"path": "nowhere.onnx"}))


def not_onnx(scene: Scene) -> None:
    (scene.tmp / "notes.onnx").write_text("this is not a protobuf")
    scene.use(config=scene.config(model={"path": str(scene.tmp / "notes.onnx")}))


def unreachable_broker(scene: Scene) -> None:
    scene.use(config=scene.config(kafka={"bootstrap_servers": f"127.0.0.1:{free_port()}"}))


def rest_port_taken(scene: Scene) -> None:
    scene.use(config=scene.config(flink={"rest_port": scene.listen()}))


def http_port_taken(scene: Scene) -> None:
    scene.use(config=scene.config(http={"port": scene.listen()}))


def broker_port_not_kafka(scene: Scene) -> None:
    scene.use(config=scene.config(kafka={"bootstrap_servers": f"127.0.0.1:{scene.listen()}"}))


def repository(scene: Scene, servable: str | None = None, version: bytes | None = None) -> None:
    """A config serving a repository of the sample model as `m` version 1, with `servable` as its
    servable.yaml and `version` as the bytes of a version 2."""
    root = scene.tmp / "models"
    (root / "m" / "1").mkdir(parents=True)
    (root / "m" / "1" / "model.onnx").write_bytes(scene.sample_model.read_bytes())
    if servable is not None:
        (root / "m" / "servable.yaml").write_text(servable)
    if version is not None:
        (root / "m" / "2").mkdir()
        (root / "m" / "2" / "model.onnx").write_bytes(version)
    scene.use(config=scene.config(models={"repository": str(root)}))


def valid(scene: Scene) -> None:
    scene.use(config=scene.config())


def running(scene: Scene) -> None:
    """A live instance of {config}."""
    valid(scene)
    scene.hold(Path(scene.values["config"]))


def running_copy(scene: Scene, **changes: dict) -> None:
    """{config} runs; {other} is its copy in another folder, with `changes`."""
    running(scene)
    scene.use(other=scene.copy(Path(scene.values["config"]), "b", **changes))


def other_ports(scene: Scene, **flink: str) -> dict:
    return {"flink": {"rest_port": free_port(), **flink}, "http": {"port": free_port()}}


def same_checkpoints(scene: Scene) -> None:
    """{other} differs from the running {config} in everything but its checkpoint folder."""
    running(scene)
    config = Path(scene.values["config"])
    checkpoints = str(load_config(config).flink.checkpoint_dir)
    scene.use(other=scene.copy(config, "b", **other_ports(scene, checkpoint_dir=checkpoints), kafka={"group_id": "other"}))


def running_with_local_broker(scene: Scene) -> None:
    """{config} runs the local broker (the shared one's port, as far as its record says); {other}
    differs in everything else."""
    valid(scene)
    config = Path(scene.values["config"])
    scene.hold(config, "start", int(scene.broker.bootstrap_servers.rsplit(":", 1)[1]))
    scene.use(other=scene.copy(config, "b", **other_ports(scene), kafka={"group_id": "other"}))


def running_demo(scene: Scene) -> None:
    folder = scene.tmp / "demo"
    scene.hold(init_folder(folder), "demo")
    scene.use(folder=folder)


def two_running(scene: Scene) -> None:
    running(scene)
    scene.hold(scene.config("b"))


CASES = [
    Case("start: a bad value", (*CLI, "start", "-c", "{config}"), "batching.batch_size: must be between 1 and 65536, got 0", bad_value),
    Case("start: no config file", (*CLI, "start", "-c", "nowhere.yaml"), "config file not found"),
    Case("start: no model file", (*CLI, "start", "-c", "{config}"), "model.path: model file not found", missing_model),
    Case("start: a model that is not ONNX", (*CLI, "start", "-c", "{config}"), "not an ONNX model", not_onnx),
    Case("start: model.inputs the model lacks", (*CLI, "start", "-c", "{config}"),
         "model.inputs ['pixels'] do not match the model's inputs ['features']",
         lambda scene: scene.use(config=scene.config(model={"inputs": ["pixels"]}))),
    Case("start: model.outputs the model lacks", (*CLI, "start", "-c", "{config}"), "model.outputs: the model has no output 'logits'",
         lambda scene: scene.use(config=scene.config(model={"outputs": ["logits"]}))),
    Case("start: image settings for a missing input", (*CLI, "start", "-c", "{config}"),
         "preprocess.images.photo: the model has no input 'photo'",
         lambda scene: scene.use(config=scene.config(preprocess={"images": {"photo": {"layout": "CHW"}}}))),
    Case("start: a repository folder that is not there", (*CLI, "start", "-c", "{config}"),
         "models.repository: not a folder", lambda scene: scene.use(config=scene.config(models={"repository": "nowhere"}))),
    Case("start: a servable.yaml key that does not exist", (*CLI, "start", "-c", "{config}"),
         "servable.yaml: batching.size: unknown key (known: batch_size, max_delay_ms, run_batch_size)",
         lambda scene: repository(scene, servable="batching: {size: 8}")),
    Case("start: a newest version that is not ONNX", (*CLI, "start", "-c", "{config}"),
         "models.repository: model 'm' version 2: cannot load model", lambda scene: repository(scene, version=b"not onnx")),
    Case("start: a default model the repository lacks", (*CLI, "start", "-c", "{config}"),
         "models.default: no model 'nobody'; the repository serves m",
         lambda scene: (repository(scene), scene.use(config=scene.copy(Path(scene.values["config"]), "b", models={"default": "nobody"})))),
    Case("cluster_serving.job alone: a stage function servable.py lacks", ("-m", "cluster_serving.job.main", "-c", "{config}"),
         "servable.py does not exist", lambda scene: repository(scene, servable="preprocess: {function: clip}")),
    Case("start: a stage function servable.py lacks", (*CLI, "start", "-c", "{config}"),
         "servable.py does not exist", lambda scene: repository(scene, servable="preprocess: {function: clip}")),
    Case("start: a missing connector jar", (*CLI, "start", "-c", "{config}"), "flink.jars: jar not found",
         lambda scene: scene.use(config=scene.config(flink={"jars": ["/nowhere/connector.jar"]}))),
    Case("start: an unreachable broker", (*CLI, "start", "-c", "{config}"), "no Kafka broker reachable at", unreachable_broker),
    Case("start: something else listens at the broker's address", (*CLI, "start", "-c", "{config}"),
         "no Kafka broker answered", broker_port_not_kafka),
    Case("start: a kafka.properties name the bridge's librdkafka does not know", (*CLI, "start", "-c", "{config}"),
         'kafka.properties: No such configuration property: "ssl.cafile"',
         lambda scene: scene.use(config=scene.config(kafka={"properties": {"ssl.cafile": "/nowhere"}}))),
    Case("start: the Flink REST port taken", (*CLI, "start", "-c", "{config}"), "flink.rest_port: 127.0.0.1:", rest_port_taken),
    Case("start: the HTTP port taken", (*CLI, "start", "-c", "{config}"), "http.port: 127.0.0.1:", http_port_taken),
    Case("start --local-broker: the broker port taken by something else", (*CLI, "start", "-c", "{config}", "--local-broker"),
         "which is not a Kafka broker", broker_port_not_kafka),
    Case("start: no Java", (*CLI, "start", "-c", "{config}"), "java not found", valid, no_java=True),
    Case("start: twice on one config", (*CLI, "start", "-c", "{config}"), "already runs in", running),
    Case("start: a copy with the same ports, elsewhere", (*CLI, "start", "-c", "{other}"), "already uses port", running_copy),
    Case("start: other ports, the same topic and group", (*CLI, "start", "-c", "{other}"),
         "already uses consumer group", lambda scene: running_copy(scene, **other_ports(scene))),
    Case("start: other ports and group, the same checkpoint folder", (*CLI, "start", "-c", "{other}"),
         "already uses the checkpoint folder", same_checkpoints),
    Case("start --local-broker: another instance's local broker", (*CLI, "start", "-c", "{other}", "--local-broker"),
         "(its local broker)", running_with_local_broker),
    Case("start: an unknown option", (*CLI, "start", "--nope"), "unrecognized arguments: --nope"),
    Case("no command", CLI, "the following arguments are required"),
    Case("demo: while a demo runs in its folder", (*CLI, "demo", "--folder", "{folder}", "--no-wait"), "already runs in", running_demo),
    Case("demo: no Java", (*CLI, "demo", "--folder", "{data}-demo", "--no-wait"), "java not found", no_java=True),
    Case("demo: a bad --requests", (*CLI, "demo", "--requests", "many"), "argument --requests: invalid int value"),
    Case("stop: a config that does not run, while another does", (*CLI, "stop", "-c", "{other}"), "no instance runs with",
         lambda scene: running_copy(scene, **other_ports(scene), kafka={"group_id": "other"})),
    Case("stop: several running, no -c", (*CLI, "stop"), "2 instances run, name one with -c", two_running),
    Case("status: several running, no -c", (*CLI, "status"), "2 instances run, name one with -c", two_running),
    Case("restart: nothing runs with the config", (*CLI, "restart", "-c", "{config}"), "no `cluster-serving start` runs with", valid),
    Case("restart: a demo", (*CLI, "restart", "-c", "{folder}/config.yaml"), "is a demo, whose job stops and starts with it", running_demo),
    Case("restart: a bad value", (*CLI, "restart", "-c", "{config}"), "batching.batch_size", bad_value),
    Case("status: a bad value", (*CLI, "status", "-c", "{config}"), "batching.batch_size", bad_value),
    Case("http: no model file", (*CLI, "http", "-c", "{config}"), "model.path: model file not found", missing_model),
    Case("http: a kafka.properties name the bridge's librdkafka does not know", (*CLI, "http", "-c", "{config}"),
         'kafka.properties: No such configuration property: "ssl.cafile"',
         lambda scene: scene.use(config=scene.config(kafka={"properties": {"ssl.cafile": "/nowhere"}}))),
    Case("http: the port taken", (*CLI, "http", "-c", "{config}"), "http.port: cannot listen on", http_port_taken),
    Case("http: an unreachable broker", (*CLI, "http", "-c", "{config}"), "no Kafka broker reachable at", unreachable_broker),
    Case("http: something else listens at the broker's address", (*CLI, "http", "-c", "{config}"),
         "no Kafka broker answered", broker_port_not_kafka),
    Case("cluster_serving.http alone: an unknown option", ("-m", "cluster_serving.http.server", "--nope"), "unrecognized arguments: --nope"),
    Case("cluster_serving.http alone: a model that is not ONNX", ("-m", "cluster_serving.http.server", "-c", "{config}"), "not an ONNX model", not_onnx),
    Case("cluster_serving.job alone: the Flink REST port taken", ("-m", "cluster_serving.job.main", "-c", "{config}"), "flink.rest_port: 127.0.0.1:", rest_port_taken),
    Case("cluster_serving.job alone: an unreachable broker", ("-m", "cluster_serving.job.main", "-c", "{config}"), "no Kafka broker reachable at", unreachable_broker),
    Case("cluster_serving.job alone: something else listens at the broker's address", ("-m", "cluster_serving.job.main", "-c", "{config}"),
         "no Kafka broker answered", broker_port_not_kafka),
    Case("cluster_serving.job alone: a kafka.properties name kafka-python does not know", ("-m", "cluster_serving.job.main", "-c", "{config}"),
         "kafka.properties: kafka-python, which sets up the topics, refuses them: Unrecognized configs: {'max_poll_records'}",
         lambda scene: scene.use(config=scene.config(kafka={"properties": {"max.poll.records": "5000"}}))),
    Case("cluster_serving.job alone: an unknown option", ("-m", "cluster_serving.job.main", "--nope"), "unrecognized arguments: --nope"),
    Case("cluster_serving.job alone: no Java", ("-m", "cluster_serving.job.main", "-c", "{config}"), "java not found", valid, no_java=True),
    Case("init: a file where the folder goes", (*CLI, "init", "{config}"), "is a file", valid),
    Case("broker: the port taken", (*CLI, "broker", "--port", "{port}", "--data", "{data}"), "is in use",
         lambda scene: scene.use(port=scene.listen())),
    Case("broker: the data folder of a running broker", (*CLI, "broker", "--port", "0", "--data", "{data}"),
         "is the data folder of a broker that runs now", lambda scene: scene.use(data=scene.broker.data)),
    Case("broker: no Java", (*CLI, "broker", "--port", "0", "--data", "{data}"), "java not found", no_java=True),
    Case("replay: --version without --model", (*CLI, "replay", "-c", "{config}", "--from", "0", "--version", "2", "--into", "side"),
         "--version needs --model", valid),
    Case("replay: a model the repository lacks", (*CLI, "replay", "-c", "{config}", "--from", "0", "--model", "nobody", "--into", "side"),
         "--model: no model 'nobody' in the repository (it has m)", repository),
    Case("replay: a version the model lacks", (*CLI, "replay", "-c", "{config}", "--from", "0", "--model", "m", "--version", "7",
                                               "--into", "side"), "--version: model 'm' has no version 7 (it has [1])", repository),
    Case("replay: into the job's own topic", (*CLI, "replay", "-c", "{config}", "--from", "0", "--into", "serving_result"),
         "--into serving_result: the replay writes to a side topic", lambda scene: scene.use(config=scene.config(kafka={"result_topic": "serving_result"}))),
    Case("replay: a --from that is no position", (*CLI, "replay", "--from", "yesterday", "--into", "side"),
         "argument --from: 'yesterday' is neither an offset nor a time"),
    Case("bench: a bad argument", (*CLI, "bench", "--requests", "5"), "--requests: at least 1000"),
    Case("bench: an unreachable broker", (*CLI, "bench", "--models", "mlp", "--requests", "1000", "--bootstrap", "{address}"),
         "no Kafka broker reachable at", lambda scene: scene.use(address=f"127.0.0.1:{free_port()}")),
]


@pytest.fixture
def scene(tmp_path: Path, broker: LocalBroker, sample_model: Path) -> Iterator[Scene]:
    world = Scene(tmp_path, broker, sample_model)
    yield world
    world.close()


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_one_error_line(case: Case, scene: Scene) -> None:
    case.setup(scene)
    env = dict(scene.env)
    if case.no_java:
        env.pop("JAVA_HOME", None)
        env["PATH"] = str(Path(sys.executable).parent)  # the venv's python, no java
    argv = [sys.executable, *(arg.format(**scene.values) for arg in case.argv)]
    began = time.monotonic()
    done = subprocess.run(argv, cwd=scene.tmp, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - began

    shown = f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, shown
    assert len(lines) == 1 and lines[0].startswith("error: "), shown
    assert case.expected in lines[0], shown
    assert "Traceback" not in done.stdout + done.stderr, shown
    assert elapsed < LOCAL_S, f"{elapsed:.1f} s\n{shown}"
    holders = {holder.pid for holder in scene.holders}
    assert [pid for pid in pids_naming(scene.tmp) if pid not in holders] == [], "a process was left behind"


def test_broker_problem_tells_nothing_listening_a_stranger_and_a_broker_apart(scene: Scene) -> None:
    """A listener that is not Kafka passes the TCP probe; `start`, `status`, the job and the bridge
    must still say so in seconds instead of retrying for a Kafka client's whole timeout."""
    config = load_config(scene.config())
    stranger = config.kafka.model_copy(update={"bootstrap_servers": f"127.0.0.1:{scene.listen()}"})
    nobody = config.kafka.model_copy(update={"bootstrap_servers": f"127.0.0.1:{free_port()}"})
    assert (broker_problem(nobody), broker_problem(stranger), broker_problem(config.kafka)) == (
        NOTHING_LISTENS, NOT_KAFKA, None)


def test_status_names_a_listener_that_is_not_kafka(scene: Scene) -> None:
    """`status` is no error (nothing runs), but its broker line says what is wrong there, in seconds."""
    address = f"127.0.0.1:{scene.listen()}"
    scene.use(config=scene.config(kafka={"bootstrap_servers": address}))
    began = time.monotonic()
    done = subprocess.run([sys.executable, *CLI, "status", "-c", scene.values["config"]], cwd=scene.tmp,
                          env=scene.env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - began
    broker_lines = [line for line in done.stdout.splitlines() if line.startswith("broker:")]
    assert broker_lines == [f"broker: not usable at {address}: {NOT_KAFKA}"], done
    assert elapsed < LOCAL_S, f"{elapsed:.1f} s"
