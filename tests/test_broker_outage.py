"""The broker is the one thing everything shares: killed mid-stream and started again, or away for
a minute, the job recovers by itself with nothing lost (and nothing twice under exactly-once),
clients buffer meanwhile, and the bridge and `status` say what is wrong."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest

from cluster_serving.client import DeliveryError, InputQueue, OutputQueue
from cluster_serving.config import load_config
from cluster_serving.ops.children import HttpBridge, LocalBroker
from cluster_serving.ops.operations import kafka_figures
from cluster_serving.ops.processes import free_port, write_run_config
from cluster_serving.ops.sample_model import FEATURES, build_sample_model
from tests.conftest import http_call


class OwnBroker:
    """A broker of this test's own, on one port and data folder, that can be killed and started again."""

    def __init__(self, folder: Path):
        self.folder, self.port, self.starts = folder, free_port(), 0
        self.broker = self._start()

    def _start(self) -> LocalBroker:
        self.starts += 1
        broker = LocalBroker(self.folder / "kafka", port=self.port, log_path=self.folder / f"broker-{self.starts}.log")
        return broker.start()

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        """SIGKILL to the broker's JVM: no controlled shutdown, no flush."""
        (jvm,) = psutil.Process(self.broker.process.pid).children()
        jvm.kill()
        self.broker.process.wait(30)

    def stop(self) -> None:
        self.broker.stop()

    def start_again(self) -> None:
        self.broker = self._start()


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[OwnBroker]:
    broker = OwnBroker(tmp_path)
    yield broker
    broker.stop()


class PacedSender(threading.Thread):
    """Sends `count` numbered requests at `rate` per second through one InputQueue."""

    PREFIX = "r"

    def __init__(self, inputs: InputQueue, count: int, rate: float):
        super().__init__(daemon=True)
        self.inputs, self.count, self.rate = inputs, count, rate
        self.error: BaseException | None = None

    def run(self) -> None:
        started = time.monotonic()
        try:
            for i in range(self.count):
                self.inputs.enqueue(f"{self.PREFIX}{i:06d}", features=np.full(FEATURES, i % 97, np.float32))
                if (pause := started + (i + 1) / self.rate - time.monotonic()) > 0:
                    time.sleep(pause)
            self.inputs.flush()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc


def arrivals(outputs: OutputQueue, count: int, timeout: float) -> tuple[dict[str, float], int]:
    """When each uri's first result arrived (monotonic seconds), and how many came twice."""
    seen: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < count and time.monotonic() < deadline:
        for uri, _ in outputs.dequeue_all(timeout=1.0):
            seen.setdefault(uri, time.monotonic())
    return seen, outputs.store.duplicates


def longest_gap(times: list[float]) -> float:
    ordered = sorted(times)
    return max(b - a for a, b in zip(ordered, ordered[1:]))


def read_until(outputs: OutputQueue, count: int, timeout: float, seen: dict[str, float]) -> None:
    """Records when each uri's first result arrives, until `count` are in or `timeout` passes;
    while the broker is away, reading fails and is tried again."""
    deadline = time.monotonic() + timeout
    while len(seen) < count and time.monotonic() < deadline:
        try:
            batch = outputs.dequeue()
        except Exception:  # noqa: BLE001 - the broker is away: librdkafka's errors, timeouts
            time.sleep(0.5)
            continue
        now = time.monotonic()
        for uri in batch:
            if uri.startswith(PacedSender.PREFIX):  # not the bridge's
                seen.setdefault(uri, now)
        if not batch:
            time.sleep(0.1)


def run_outage(tmp_path: Path, own_broker: OwnBroker, start_job, delivery: str, count: int, rate: float,
               outage: Callable[[Path, object], float], at_s: float) -> tuple[dict[str, float], int, float, float]:
    """Serves `count` requests sent at `rate` while `outage` happens `at_s` seconds in; returns
    the arrivals, the duplicates, when the outage ended and the longest pause between results."""
    sample = build_sample_model(tmp_path / "model.onnx")
    path = write_run_config(tmp_path, sample, own_broker.bootstrap_servers, kafka={"delivery": delivery},
                            flink={"checkpoint_interval_ms": 1000})
    config = load_config(path)
    start_job(path, config)
    # Idempotent, so that a request librdkafka sends again after the broker died is kept once: a
    # request there twice (it happened once) would have two results, neither of them the job's fault.
    inputs = InputQueue(config.kafka.bootstrap_servers, config.kafka.input_topic, enable_idempotence=True)
    outputs = OutputQueue(config.kafka.bootstrap_servers, config.kafka.result_topic, group_id="outage-client")
    seen: dict[str, float] = {}
    with inputs, outputs:
        sender = PacedSender(inputs, count, rate)
        reader = threading.Thread(target=read_until, args=(outputs, count, at_s + 240, seen), daemon=True)
        sender.start()
        reader.start()
        time.sleep(at_s)
        ended = outage(path, config)
        sender.join(600)
        reader.join(600)
        assert sender.error is None, sender.error
    return seen, outputs.store.duplicates, ended, longest_gap(list(seen.values()))


def test_a_broker_sigkilled_and_started_again_loses_nothing_and_duplicates_nothing(tmp_path, own_broker, start_job) -> None:
    def kill_and_restart(path, config) -> float:
        own_broker.kill()
        own_broker.start_again()
        return time.monotonic()

    count = 10_000
    seen, duplicates, ended, gap = run_outage(tmp_path, own_broker, start_job, "exactly_once", count, 500, kill_and_restart, 6)
    print(f"broker SIGKILL + restart: {len(seen)} of {count} answered, {duplicates} duplicates, "
          f"results paused at most {gap:.1f} s, last result {max(seen.values()) - ended:.1f} s after the broker was back")
    assert len(seen) == count, f"{count - len(seen)} lost"
    assert duplicates == 0


def test_a_broker_away_for_a_minute_loses_nothing_and_the_bridge_and_status_say_why(tmp_path, own_broker, start_job) -> None:
    seen_while_away: dict[str, object] = {}

    def away_for_a_minute(path, config) -> float:
        bridge = HttpBridge(path, log_path=tmp_path / "bridge.log").start()
        body = {"instances": [{"features": [0.5] * FEATURES}]}
        try:
            assert http_call(f"{bridge.url}/predict", body)[0] == 200
            own_broker.stop()
            stopped = time.monotonic()
            time.sleep(3)  # the bridge's readiness is checked once a second
            seen_while_away["bridge"] = http_call(f"{bridge.url}/predict", body)
            seen_while_away["status"] = kafka_figures(config, None)
            impatient = InputQueue(config.kafka.bootstrap_servers, config.kafka.input_topic, message_timeout_ms=5000)
            impatient.enqueue("impatient", features=np.zeros(FEATURES, np.float32))
            began = time.monotonic()
            with pytest.raises(DeliveryError) as refused:
                impatient.flush()
            seen_while_away["enqueue"] = (str(refused.value), time.monotonic() - began)
            time.sleep(max(0.0, stopped + 60 - time.monotonic()))
            own_broker.start_again()
            back = time.monotonic()
            deadline = back + 60
            while (answer := http_call(f"{bridge.url}/predict", body))[0] != 200 and time.monotonic() < deadline:
                time.sleep(1)
            seen_while_away["bridge after"] = (answer[0], time.monotonic() - back)
            return back
        finally:
            bridge.stop()

    count = 9_000
    seen, duplicates, ended, gap = run_outage(tmp_path, own_broker, start_job, "at_least_once", count, 100, away_for_a_minute, 10)
    print(f"broker away 60 s: {len(seen)} of {count} answered, {duplicates} duplicates, results paused at most {gap:.1f} s, "
          f"last result {max(seen.values()) - ended:.1f} s after the broker was back; {seen_while_away}")
    assert len(seen) == count, f"{count - len(seen)} lost"
    status, answer = seen_while_away["bridge"]
    assert status == 503 and answer == {"error": f"not ready: no Kafka broker reachable at {own_broker.bootstrap_servers}"}, answer
    assert seen_while_away["status"]["broker"].startswith(f"not usable at {own_broker.bootstrap_servers}: ")
    message, waited = seen_while_away["enqueue"]
    assert message == (f"1 requests not written to topic {message.split(chr(39))[1]!r} ('impatient'): no broker took them within "
                       f"message.timeout.ms (5000 ms): is Kafka at {own_broker.bootstrap_servers} reachable?")
    assert waited < 15
    assert seen_while_away["bridge after"][0] == 200

