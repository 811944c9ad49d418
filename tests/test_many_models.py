"""Many models end to end on real parts: a model repository with versions, a pipeline, stages,
swaps while requests flow, and a broken version, served by an embedded job over the local broker.
Every result is compared with ONNX Runtime run directly on the model and version that served it."""

from __future__ import annotations

import random
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import yaml
from kafka import KafkaProducer
from onnx import TensorProto, helper, numpy_helper

from cluster_serving.client import InputQueue, OutputQueue
from cluster_serving.kafka.admin import topic_records
from cluster_serving.wire.codec import CONTROL_HEADER, Message, decode_message, encode_message
from tests.conftest import collect
from tests.onnx_models import WIDTH, graph_model, scale_model
from tests.test_recovery import kill_between_checkpoints


def total_model(path: Path) -> Path:
    """total = x @ [1, 2, 3, 4]: one number per instance."""
    path.parent.mkdir(parents=True, exist_ok=True)
    weight = numpy_helper.from_array(np.arange(1, WIDTH + 1, dtype=np.float32).reshape(WIDTH, 1), "weights")
    node = helper.make_node("MatMul", ["x", "weights"], ["total"])
    return graph_model(path, [("x", TensorProto.FLOAT, [WIDTH])], [node], [("total", TensorProto.FLOAT, [1])], (weight,))


def write_servable(folder: Path, settings: dict, stages: str | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "servable.yaml").write_text(yaml.safe_dump(settings))
    if stages is not None:
        (folder / "servable.py").write_text(stages)


def run_directly(model: Path, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(str(model)).run(None, {"x": x[np.newaxis]})[0][0]


REFUSE_NEGATIVE = '''
def refuse_negative(batch):
    """Batched preprocess: doubles x, raises when any instance has a negative first value."""
    for inputs in batch:
        if inputs["x"][0] < 0:
            raise ValueError("negative first value")
    return [{"x": inputs["x"] * 2} for inputs in batch]
'''


def build_repository(root: Path) -> Path:
    """scale (versions 1 and 2, all served), total, a pipeline scale v2 -> total, and staged (a
    batched preprocess function that refuses some instances)."""
    scale_model(root / "scale" / "1" / "model.onnx", 2.0)
    scale_model(root / "scale" / "2" / "model.onnx", 3.0)
    write_servable(root / "scale", {"version_policy": "all", "batching": {"batch_size": 16, "max_delay_ms": 5}})
    total_model(root / "total" / "1" / "model.onnx")
    write_servable(root / "chain", {
        "kind": "pipeline",
        "steps": [{"model": "scale", "version": 2}, {"model": "total", "inputs": {"x": "scale.y"}}],
    })
    scale_model(root / "staged" / "1" / "model.onnx", 1.0)
    write_servable(root / "staged", {"preprocess": {"function": "refuse_negative", "batched": True}}, REFUSE_NEGATIVE)
    return root


def expected(root: Path, model: str | None, version: int | None, x: np.ndarray) -> tuple[str, int, dict]:
    """(model, version, outputs) that ONNX Runtime gives run directly; no model: the default, total."""
    if model == "chain":
        y = run_directly(root / "scale" / "2" / "model.onnx", x)
        return "chain", 1, {"total": run_directly(root / "total" / "1" / "model.onnx", y)}
    if model == "scale":
        served = version or 2
        return "scale", served, {"y": run_directly(root / "scale" / str(served) / "model.onnx", x)}
    return "total", 1, {"total": run_directly(root / "total" / "1" / "model.onnx", x)}


def queues(config) -> tuple[InputQueue, OutputQueue]:
    kafka = config.kafka
    return (
        InputQueue(kafka.bootstrap_servers, kafka.input_topic),
        OutputQueue(kafka.bootstrap_servers, kafka.result_topic, group_id=f"{kafka.group_id}-client"),
    )


ROUTES = [("scale", None), ("scale", 1), ("scale", 2), ("total", None), ("total", 1), ("chain", None), (None, None)]


def test_two_thousand_mixed_requests_match_each_version_and_the_chained_pipeline(tmp_path, write_config, start_job) -> None:
    root = build_repository(tmp_path / "models")
    path, config = write_config(models={"repository": str(root), "default": "total"})
    start_job(path, config)
    rng = np.random.default_rng(7)
    picks = random.Random(7)
    requests = [(f"r{i}", *picks.choice(ROUTES), rng.normal(size=WIDTH).astype(np.float32)) for i in range(2000)]
    inputs, outputs = queues(config)
    with inputs, outputs:
        for uri, model, version, x in requests:
            inputs.enqueue(uri, model=model, version=version, x=x)
        inputs.flush()
        results = collect(outputs, len(requests), timeout=180)
        assert outputs.store.duplicates == 0
    assert sorted(results) == sorted(uri for uri, *_ in requests)
    for uri, model, version, x in requests:
        result = results[uri]
        name, served, want = expected(root, model, version, x)
        assert "error" not in result, (uri, model, version, result)
        assert (result.model, result.version) == (name, served), (uri, model, version)
        for output, value in want.items():
            np.testing.assert_allclose(result[output], value, rtol=1e-6)


def test_unknown_models_and_versions_and_a_raising_stage_answer_those_uris_only(tmp_path, write_config, start_job) -> None:
    root = build_repository(tmp_path / "models")
    path, config = write_config(models={"repository": str(root), "default": "total"})
    start_job(path, config)
    x = np.arange(WIDTH, dtype=np.float32)
    negative = {f"neg-{i}" for i in range(0, 40, 3)}
    inputs, outputs = queues(config)
    with inputs, outputs:
        inputs.enqueue("nobody", model="nobody", x=x)
        inputs.enqueue("scale-9", model="scale", version=9, x=x)
        for i in range(40):
            uri = f"neg-{i}" if f"neg-{i}" in negative else f"pos-{i}"
            inputs.enqueue(uri, model="staged", x=-x - 1 if uri in negative else x + i)
        inputs.flush()
        results = collect(outputs, 42, timeout=120)
    assert results["nobody"]["error"] == "unknown model 'nobody'; the repository serves chain, scale, staged, total"
    assert results["scale-9"]["error"] == "model 'scale' has no version 9; it serves 1, 2"
    assert (results["nobody"].error_code, results["scale-9"].error_code) == ("unknown_model", "unknown_version")
    failed = {uri for uri, result in results.items() if uri.startswith(("neg-", "pos-")) and "error" in result}
    assert failed == negative
    for uri in failed:
        assert results[uri]["error"] == "preprocess failed: ValueError: negative first value"
        assert results[uri].error_code == "preprocess_failed"
    for i in range(40):
        if f"pos-{i}" in results:
            np.testing.assert_allclose(results[f"pos-{i}"]["y"], (x + i) * 2)


def swap_in(folder: Path, factor: float) -> None:
    """A new version as an operator should add one: written aside, then renamed into place."""
    staging = folder.parent / f".{folder.name}.tmp"
    scale_model(staging / "model.onnx", factor)
    staging.rename(folder)


class SteadySender(threading.Thread):
    """Sends numbered requests to `scale` (no version) at a steady rate until stopped."""

    def __init__(self, inputs: InputQueue, rate: float):
        super().__init__(daemon=True)
        self.inputs, self.rate, self.sent = inputs, rate, 0
        self.halt = threading.Event()

    def run(self) -> None:
        started = time.monotonic()
        while not self.halt.is_set():
            self.inputs.enqueue(f"s{self.sent:06d}", model="scale", x=np.full(WIDTH, self.sent, np.float32))
            self.sent += 1
            pause = started + self.sent / self.rate - time.monotonic()
            if pause > 0:
                time.sleep(pause)
        self.inputs.flush()


def test_a_swap_under_load_loses_nothing_serves_nothing_twice_and_switches_once(tmp_path, write_config, start_job) -> None:
    root = tmp_path / "models"
    scale_model(root / "scale" / "1" / "model.onnx", 2.0)
    path, config = write_config(models={"repository": str(root), "poll_interval_s": 0.5})
    start_job(path, config)
    inputs, outputs = queues(config)
    with inputs, outputs:
        sender = SteadySender(inputs, rate=200)
        sender.start()
        time.sleep(4)
        swap_in(root / "scale" / "2", 3.0)
        time.sleep(4)
        shutil.rmtree(root / "scale" / "1")
        time.sleep(4)
        sender.halt.set()
        sender.join()
        results = collect(outputs, sender.sent, timeout=120)
        assert outputs.store.duplicates == 0
    uris = [f"s{i:06d}" for i in range(sender.sent)]
    assert sorted(results) == uris, f"{len(set(uris) - set(results))} lost"
    versions = [results[uri].version for uri in uris]
    switch = versions.index(2)
    assert set(versions[:switch]) == {1} and set(versions[switch:]) == {2}, "not one switch from version 1 to 2"
    for i, uri in enumerate(uris):
        np.testing.assert_allclose(results[uri]["y"], np.full(WIDTH, i * (2.0 if i < switch else 3.0)))


def test_a_broken_new_version_is_reported_once_and_the_old_one_keeps_serving(tmp_path, write_config, start_job) -> None:
    root = tmp_path / "models"
    scale_model(root / "scale" / "1" / "model.onnx", 2.0)
    write_servable(root / "scale", {"inputs": ["x"]})
    path, config = write_config(models={"repository": str(root), "poll_interval_s": 0.5})
    job = start_job(path, config)
    (root / "scale" / "2").mkdir()
    (root / "scale" / "2" / "model.onnx").write_bytes(b"not an onnx model")
    renamed_input = tmp_path / "renamed.onnx"  # takes z where servable.yaml says x
    graph_model(renamed_input, [("z", TensorProto.FLOAT, [WIDTH])], [helper.make_node("Identity", ["z"], ["y"])],
                [("y", TensorProto.FLOAT, [WIDTH])])
    (root / "scale" / "3").mkdir()
    shutil.copy(renamed_input, root / "scale" / "3" / "model.onnx")
    time.sleep(3)  # several polls
    inputs, outputs = queues(config)
    with inputs, outputs:
        for i in range(100):
            inputs.enqueue(f"b{i}", model="scale", x=np.full(WIDTH, i, np.float32))
        inputs.flush()
        results = collect(outputs, 100, timeout=120)
    assert sorted(results) == sorted(f"b{i}" for i in range(100))
    for i in range(100):
        assert results[f"b{i}"].version == 1
        np.testing.assert_allclose(results[f"b{i}"]["y"], np.full(WIDTH, 2.0 * i))
    log = job.log_path.read_text(errors="replace") + "".join(
        flink_log.read_text(errors="replace") for flink_log in (path.parent / "log").glob("*.log")
    )
    for version in (2, 3):
        reports = [line for line in log.splitlines() if f"model scale version {version} not served" in line]
        assert len(reports) == 1, reports


def versions_written(config) -> dict[str, list[int | None]]:
    """Every result record on the result topic (repeats included), as uri -> the versions that served it."""
    seen: dict[str, list[int | None]] = {}
    for record in topic_records(config.kafka.bootstrap_servers, config.kafka.result_topic):
        message = decode_message(record.value, 1 << 20)
        seen.setdefault(message.uri, []).append(message.model_version)
    return seen


def test_a_sigkill_after_a_swap_replays_each_request_with_the_version_that_first_served_it(
    tmp_path, write_config, start_job
) -> None:
    """At least once: requests read again after the restore are served again, but by the same
    version as before the kill, because the switch is a position in the request log. The kill lands
    midway between checkpoints 5 s apart, so that seconds of requests are read again."""
    root = tmp_path / "models"
    scale_model(root / "scale" / "1" / "model.onnx", 2.0)
    path, config = write_config(models={"repository": str(root), "poll_interval_s": 0.5},
                                flink={"checkpoint_interval_ms": 5000})
    first = start_job(path, config)
    inputs, _ = queues(config)
    with inputs:
        sender = SteadySender(inputs, rate=200)
        sender.start()
        time.sleep(3)
        swap_in(root / "scale" / "2", 3.0)
        deadline = time.monotonic() + 60
        while 2 not in {v for versions in versions_written(config).values() for v in versions} and time.monotonic() < deadline:
            time.sleep(0.2)
        kill_between_checkpoints(first, config)
        time.sleep(2)
        start_job(path, config)
        time.sleep(3)
        sender.halt.set()
        sender.join()
    uris = [f"s{i:06d}" for i in range(sender.sent)]
    deadline = time.monotonic() + 120
    while not set(uris) <= set(written := versions_written(config)) and time.monotonic() < deadline:
        time.sleep(1)
    assert set(uris) <= set(written), f"{len(set(uris) - set(written))} lost"
    assert sum(len(written[uri]) > 1 for uri in uris), "nothing was read again: the kill did not test a replay"
    for uri in uris:
        assert len(set(written[uri])) == 1, f"{uri} was served by versions {written[uri]}"
    versions = [written[uri][0] for uri in uris]
    switch = versions.index(2)
    assert set(versions[:switch]) == {1} and set(versions[switch:]) == {2}


def test_hostile_headers_and_control_records_cost_their_own_request_only(tmp_path, write_config, start_job) -> None:
    root = tmp_path / "models"
    scale_model(root / "scale" / "1" / "model.onnx", 2.0)
    path, config = write_config(models={"repository": str(root)})
    job = start_job(path, config)
    kafka = config.kafka
    body = {uri: encode_message(Message(uri, {"x": np.ones(WIDTH, np.float32)})) for uri in ("long", "binary", "digits", "good")}
    producer = KafkaProducer(bootstrap_servers=kafka.bootstrap_servers, max_request_size=8 << 20)
    for uri, headers in (
        ("long", [("model", b"m" * (1 << 20))]),
        ("binary", [("model", b"\xff\xfe\x00")]),
        ("digits", [("model", b"scale"), ("version", "\u0661".encode())]),  # an Arabic-Indic 1
    ):
        producer.send(kafka.input_topic, key=uri.encode(), value=body[uri], headers=headers)
    for garbage in (b"", b"not a table", b"9" * 30 + b"\tscale\nscale\t0\t0\t1"):
        producer.send(kafka.input_topic, value=garbage, headers=[(CONTROL_HEADER, b"")])
    producer.send(kafka.input_topic, key=b"good", value=body["good"])
    producer.flush()
    producer.close()
    outputs = OutputQueue(kafka.bootstrap_servers, kafka.result_topic, group_id=f"{kafka.group_id}-client")
    with outputs:
        results = collect(outputs, 4, timeout=120)
    np.testing.assert_allclose(results["good"]["y"], np.full(WIDTH, 2.0))
    assert results["good"].version == 1
    assert results["long"]["error"] == f"unknown model {'m' * 100!r}; the repository serves scale"
    assert results["binary"]["error"].startswith("unknown model ")
    assert results["digits"]["error"] == "model 'scale' has no version \u0661; it serves 1"
    logs = job.log_path.read_text(errors="replace") + "".join(
        flink_log.read_text(errors="replace") for flink_log in (path.parent / "log").glob("*.log")
    )
    assert "Traceback" not in logs and "dropped a control record without a valid signature" in logs
