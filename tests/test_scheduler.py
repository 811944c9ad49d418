"""The scheduler (runtime/scheduler.py) without Flink: each model's batches on its own lane, so that
one held up costs the others nothing; instances, queue bounds, drains and routing tables.

The slow model here is held up on purpose: its preprocess function waits until the test opens a
gate (a file), so that what runs when is decided by the test, not by timing."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import yaml

from cluster_serving.config import load_config
from cluster_serving.runtime.decode import decode_frame
from cluster_serving.runtime.frames import DRAIN, POLL, write_batch_frame, write_control_frame, write_signal_frame
from cluster_serving.runtime.outcomes import as_messages
from cluster_serving.runtime import servables
from cluster_serving.runtime.repository import RoutingTable, scan
from cluster_serving.runtime.scheduler import INLINE_US, Done, Scheduler
from cluster_serving.runtime.serve import BatchServer
from cluster_serving.wire.codec import Message, encode_message
from tests.onnx_models import WIDTH, scale_model

GATED = """import time
from pathlib import Path

GATE = Path(__file__).parent / "gate"


def wait_for_gate(inputs):
    while not GATE.exists():
        time.sleep(0.005)
    return inputs
"""
# How long a test waits for what must happen before it calls the scheduler broken (never a timing check).
PATIENCE_S = 30


def repository(root: Path, slow: dict) -> Path:
    """Two models: `fast` (y = 2x) and `slow` (y = 3x behind the gate), slow's servable.yaml extended by `slow`."""
    scale_model(root / "fast" / "1" / "model.onnx", 2.0)
    scale_model(root / "slow" / "1" / "model.onnx", 3.0)
    (root / "slow" / "servable.yaml").write_text(yaml.safe_dump({"preprocess": {"function": "wait_for_gate"}, **slow}))
    (root / "slow" / "servable.py").write_text(GATED)
    return root / "slow" / "gate"


@pytest.fixture
def scheduled(tmp_path: Path):
    """Makes (scheduler, gate) for a repository whose slow model has these servable.yaml settings."""
    schedulers = []

    def make(**slow) -> tuple[Scheduler, Path]:
        gate = repository(tmp_path / "models", slow)
        config = load_config(overrides={"models.repository": str(tmp_path / "models"), "models.default": "fast",
                                        "batching.batch_size": 4})
        scheduler = Scheduler(BatchServer(config))
        schedulers.append((scheduler, gate))
        assert scheduler.submit(batch_of(write_control_frame(RoutingTable.of(scan(config)).text()))) == []
        return scheduler, gate

    yield make
    for scheduler, gate in schedulers:
        gate.touch()
        scheduler.close()


def batch_of(frame: bytes):
    return decode_frame(frame, load_config().limits)


def requests(model: str, *uris: str):
    """A batch frame of requests to `model`, request i's x all i + 1."""
    records = [(uri, encode_message(Message(uri, {"x": np.full(WIDTH, i + 1, np.float32)}))) for i, uri in enumerate(uris)]
    return batch_of(write_batch_frame(model, "", records))


def results(done: list[Done]) -> dict[str, Message]:
    return {message.uri: message for item in done for message in as_messages(item.outcomes)}


def until(condition: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.002)


def collect(scheduler: Scheduler, uris: set[str]) -> dict[str, Message]:
    """Polls as the JVM does until the results of `uris` are in."""
    got: dict[str, Message] = {}
    until(lambda: uris <= got.keys() or got.update(results(scheduler.submit(batch_of(write_signal_frame(POLL))))),
          f"results for {sorted(uris)}")
    return got


def test_a_held_up_model_costs_another_nothing(scheduled) -> None:
    scheduler, gate = scheduled()
    assert scheduler.submit(requests("slow", "s0", "s1")) == []
    assert scheduler.held == 1
    answered = results(scheduler.submit(requests("fast", "f0", "f1"))) | collect(scheduler, {"f0", "f1"})
    np.testing.assert_array_equal(answered["f1"].tensors["y"], np.full(WIDTH, 4, np.float32))
    assert "s0" not in answered and scheduler.held == 1  # the slow batch is still at its gate
    gate.touch()
    slow = results(scheduler.submit(batch_of(write_signal_frame(DRAIN))))
    assert scheduler.held == 0
    assert [(uri, slow[uri].model, slow[uri].tensors["y"][0]) for uri in ("s0", "s1")] == [("s0", "slow", 3.0), ("s1", "slow", 6.0)]


def test_a_fast_model_runs_on_the_stage_thread_once_its_batches_are_known_to_be_fast(scheduled) -> None:
    scheduler, _ = scheduled()
    assert scheduler.submit(requests("fast", "first")) == []  # its first batch: time unknown, on its lane
    collect(scheduler, {"first"})
    lane = scheduler.lanes[("fast", 1)]
    for i in range(100):  # a first run can be slow (ONNX Runtime plans its memory): the estimate comes down
        done = scheduler.submit(requests("fast", f"b{i}"))
        collect(scheduler, set() if done else {f"b{i}"})
        if done:
            break
    assert lane.expected_us(1) < INLINE_US and scheduler.held == 0
    assert results(done)[f"b{i}"].tensors["y"][0] == 2.0


def test_a_full_queue_refuses_clearly_and_serves_the_rest(scheduled) -> None:
    scheduler, gate = scheduled(max_queue_size=2)
    assert scheduler.submit(requests("slow", "r0")) == []
    until(lambda: scheduler.lanes[("slow", 1)].running == 1, "the first slow batch running")
    for uri in ("r1", "r2"):  # one running (at its gate), two waiting: the queue is full
        assert scheduler.submit(requests("slow", uri)) == []
    refused = results(scheduler.submit(requests("slow", "r3", "r4")))
    assert {uri: (m.error_code, m.model) for uri, m in refused.items()} == {"r3": ("overloaded", "slow"), "r4": ("overloaded", "slow")}
    assert refused["r3"].error == ("model slow version 1 is overloaded: 2 requests wait for its 1 instance(s), "
                                   "max_queue_size is 2; not run, send again later")
    assert results(scheduler.submit(requests("fast", "f"))) | collect(scheduler, {"f"})  # the other model serves on
    gate.touch()
    served = results(scheduler.drain())
    assert {uri: m.tensors["y"][0] for uri, m in served.items()} == {"r0": 3.0, "r1": 3.0, "r2": 3.0}


def test_without_a_bound_the_stage_waits_for_room(scheduled) -> None:
    scheduler, gate = scheduled()
    for uri in ("w0", "w1"):  # one running, one waiting: the lane of one instance is full
        scheduler.submit(requests("slow", uri))
    returned: list[Done] = []
    thread = threading.Thread(target=lambda: returned.extend(scheduler.submit(requests("slow", "w2"))))
    thread.start()
    thread.join(0.3)
    assert thread.is_alive()  # backpressure: the stage thread waits for room
    gate.touch()
    thread.join(PATIENCE_S)
    assert set(results(returned) | results(scheduler.drain())) == {"w0", "w1", "w2"}


def test_instances_run_a_models_batches_at_once(scheduled) -> None:
    scheduler, gate = scheduled(instances=2)
    for uri in ("i0", "i1", "i2"):
        scheduler.submit(requests("slow", uri))
    lane = scheduler.lanes[("slow", 1)]
    until(lambda: lane.running == 2, "two slow batches running together")
    assert lane.waiting_batches == 1
    assert scheduler.server.servables.served["slow"].pools[1].size == 2
    gate.touch()
    assert set(results(scheduler.drain())) == {"i0", "i1", "i2"}


@pytest.mark.parametrize("provider, copies", [("CPUExecutionProvider", 1), ("CUDAExecutionProvider", 4)])
def test_instances_0_opens_four_copies_on_a_gpu_and_one_on_the_cpu(scheduled, monkeypatch: pytest.MonkeyPatch,
                                                                  provider: str, copies: int) -> None:
    """The default: four copies where the model runs on a GPU (this machine has none, so the
    opened models are marked as CUDA's), and its lane runs them all; a repeated table keeps them."""
    real = servables.open_version

    def open_on(*args):
        model = real(*args)
        model.provider = provider
        return model

    monkeypatch.setattr(servables, "open_version", open_on)
    scheduler, gate = scheduled(instances=0)
    pool = scheduler.server.servables.served["slow"].pools[1]
    assert (pool.size, scheduler.server.servables.served["fast"].pools[1].size) == (copies, copies)
    uris = {f"g{i}" for i in range(copies)}
    for uri in sorted(uris):
        scheduler.submit(requests("slow", uri))
    until(lambda: scheduler.lanes[("slow", 1)].running == copies, f"{copies} slow batch(es) running")
    gate.touch()
    assert set(results(scheduler.drain())) == uris
    table = scheduler.server.servables.table
    scheduler.submit(batch_of(write_control_frame(RoutingTable(table.generation + 1, table.default, table.entries).text())))
    assert scheduler.server.servables.served["slow"].pools[1] is pool


def test_a_routing_table_waits_for_the_batches_held(scheduled, tmp_path: Path) -> None:
    scheduler, gate = scheduled()
    scheduler.submit(requests("slow", "t0"))
    config = scheduler.server.config
    table = RoutingTable.of(scan(config))
    newer = RoutingTable(table.generation + 1, table.default, table.entries)
    adopted: list[Done] = []
    thread = threading.Thread(target=lambda: adopted.extend(scheduler.submit(batch_of(write_control_frame(newer.text())))))
    thread.start()
    thread.join(0.3)
    assert thread.is_alive()  # the old table's batch is answered first
    gate.touch()
    thread.join(PATIENCE_S)
    assert set(results(adopted)) == {"t0"} and scheduler.server.servables.table == newer
    assert scheduler.lanes == {}  # their threads let go; the versions served now get new lanes
    assert results(scheduler.submit(requests("fast", "after"))) | collect(scheduler, {"after"})


def test_a_batch_that_breaks_its_lane_is_every_requests_error(scheduled, monkeypatch) -> None:
    scheduler, _ = scheduled()

    def broken(routed):
        raise RuntimeError("a bug")

    monkeypatch.setattr(scheduler.server, "run", broken)
    scheduler.submit(requests("fast", "b0", "b1"))
    answered = collect(scheduler, {"b0", "b1"})
    assert {uri: (m.error, m.error_code) for uri, m in answered.items()} == {
        uri: ("internal error: RuntimeError: a bug", "internal") for uri in ("b0", "b1")}
    assert results(scheduler.submit(requests("nobody", "u")))["u"].error_code == "unknown_model"
