"""The whole path against a secured broker, as production Kafka is: TLS, SASL/SCRAM users and
ACLs (`cluster-serving broker --secure`). One set of kafka.properties in the config reaches every
component: the job (Java connector), the repository poller and start-up checks (kafka-python),
the bridge, the client library and `status` (librdkafka). A client with wrong credentials gets one
clear error; a principal allowed only to write requests cannot change what is served."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from confluent_kafka import KafkaError, Producer

from cluster_serving.client import DeliveryError, InputQueue, OutputQueue
from cluster_serving.config import load_config
from cluster_serving.ops.children import LocalBroker
from cluster_serving.ops.instances import REGISTRY_ENV
from cluster_serving.ops.processes import free_port, write_run_config
from cluster_serving.wire.codec import CONTROL_HEADER
from tests.conftest import collect, http_call
from tests.onnx_models import WIDTH, scale_model
from tests.paths import PROJECT_ROOT
from tests.test_cli_start import cli, wait_until_ready
from tests.test_control_records import NO_VERSIONS
from tests.test_many_models import swap_in

REQUESTS = "secured-requests"


def keywords(properties: dict[str, str]) -> dict[str, str]:
    """kafka.properties as InputQueue/OutputQueue keywords."""
    return {key.replace(".", "_"): value for key, value in properties.items()}


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBroker]:
    folder = tmp_path_factory.mktemp("secured")
    broker = LocalBroker(folder / "kafka", port=free_port(), log_path=folder / "broker.log", topics={REQUESTS: 2},
                         secure_for=REQUESTS)
    broker.start()
    yield broker
    broker.stop()


def test_broker_secure_prints_the_settings_and_refuses_what_acls_do_not_allow(secured: LocalBroker) -> None:
    printed = secured.log_path.read_text()
    serving = secured.client_properties()
    assert f"sasl.username: serving\n  sasl.password: {serving['sasl.password']}" in printed
    assert serving["security.protocol"] == "SASL_SSL" and Path(serving["ssl.ca.location"]).is_file()
    outcomes = []
    for topic in (REQUESTS, "results-of-someone"):
        requester = Producer({"bootstrap.servers": secured.bootstrap_servers, **secured.client_properties("requester")})
        requester.produce(topic, b"x", on_delivery=lambda error, _: outcomes.append(error and error.code()))
        requester.flush(30)
    assert outcomes == [None, KafkaError.TOPIC_AUTHORIZATION_FAILED]


def test_wrong_credentials_are_one_clear_error(secured: LocalBroker, tmp_path: Path, sample_model: Path) -> None:
    wrong = {**secured.client_properties(), "sasl.password": "not-the-password"}
    path = write_run_config(tmp_path, sample_model, secured.bootstrap_servers, kafka={"properties": wrong})
    refused = f"Kafka at {secured.bootstrap_servers} refused this client: sasl_ssl://{secured.bootstrap_servers}/bootstrap: " \
              "SASL authentication error: Authentication failed during authentication due to invalid credentials"
    env = {**os.environ, REGISTRY_ENV: str(tmp_path / "registry")}
    for command in (["-m", "cluster_serving.ops.cli", "start", "-c", str(path)],
                    ["-m", "cluster_serving.http.server", "--config", str(path)]):
        done = subprocess.run([sys.executable, *command], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stdout + done.stderr
        (line,) = done.stderr.strip().splitlines()
        assert line.startswith(f"error: kafka.properties: {refused}") and line.endswith("; check the credentials and TLS settings"), line
    shown = cli(env, "status", "-c", str(path))
    assert f"broker: not usable at {secured.bootstrap_servers}: {refused}" in shown.stdout, shown.stdout

    inputs = InputQueue(secured.bootstrap_servers, REQUESTS, **keywords(wrong))
    started = time.monotonic()
    with pytest.raises(DeliveryError, match="Kafka at .* refused this client: .*SASL authentication error: "
                                            "Authentication failed .* invalid credentials"):
        inputs.enqueue("r", x=np.zeros(4, np.float32))
        inputs.flush()
    assert time.monotonic() - started < 30
    outputs = OutputQueue(secured.bootstrap_servers, REQUESTS, group_id="wrong", **keywords(wrong))
    started = time.monotonic()
    with pytest.raises(ConnectionRefusedError, match=f"results of topic '{REQUESTS}' cannot be read: Kafka at .* refused "
                                                     "this client: .*SASL authentication error"):
        outputs.dequeue()
    assert time.monotonic() - started < 30


def test_the_whole_path_serves_over_tls_and_scram_and_a_request_writer_cannot_change_what_is_served(
    secured: LocalBroker, tmp_path: Path
) -> None:
    root = tmp_path / "models"
    scale_model(root / "scale" / "1" / "model.onnx", 2.0)
    path = write_run_config(
        tmp_path, root / "scale" / "1" / "model.onnx", secured.bootstrap_servers,
        kafka={"input_topic": REQUESTS, "properties": secured.client_properties()},
        models={"repository": str(root), "poll_interval_s": 0.5}, flink={"checkpoint_interval_ms": 1000},
    )
    config = load_config(path)
    url = f"http://127.0.0.1:{config.http.port}"
    env = {**os.environ, REGISTRY_ENV: str(tmp_path / "registry")}
    start = subprocess.Popen([sys.executable, "-m", "cluster_serving.ops.cli", "start", "-c", str(path)], cwd=PROJECT_ROOT,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    serving = keywords(secured.client_properties())
    try:
        wait_until_ready(url, start)
        inputs = InputQueue(config.kafka.bootstrap_servers, config.kafka.input_topic, **serving)
        outputs = OutputQueue(config.kafka.bootstrap_servers, config.kafka.result_topic, group_id="secured-client", **serving)
        with inputs, outputs:
            for i in range(200):
                inputs.enqueue(f"a{i}", model="scale", x=np.full(WIDTH, i, np.float32))
            inputs.flush()
            results = collect(outputs, 200, timeout=120)
            assert [results[f"a{i}"].version for i in range(200)] == [1] * 200
            np.testing.assert_allclose(results["a7"]["y"], np.full(WIDTH, 14.0))

            status, body = http_call(f"{url}/v2/models/scale/infer", {"inputs": [
                {"name": "x", "shape": [1, WIDTH], "datatype": "FP32", "data": [1.0] * WIDTH}]})
            assert status == 200 and body["outputs"][0]["data"] == [2.0] * WIDTH, body

            requester = Producer({"bootstrap.servers": secured.bootstrap_servers, **secured.client_properties("requester")})
            requester.produce(config.kafka.input_topic, NO_VERSIONS.encode(), headers=[(CONTROL_HEADER, b"table")])
            requester.flush(30)
            for i in range(50):
                inputs.enqueue(f"b{i}", model="scale", x=np.full(WIDTH, i, np.float32))
            inputs.flush()
            # The bridge's result above may come with these: wait for these uris, not a count.
            results = collect(outputs, 50, timeout=120, uris={f"b{i}" for i in range(50)})
            assert [results[f"b{i}"].version for i in range(50)] == [1] * 50

            swap_in(root / "scale" / "2", 3.0)  # the repository poller's table goes over SASL_SSL too
            deadline = time.monotonic() + 60
            version = None
            while version != 2 and time.monotonic() < deadline:
                inputs.enqueue(f"c{time.monotonic_ns()}", model="scale", x=np.ones(WIDTH, np.float32))
                inputs.flush()
                version = next(iter(collect(outputs, 1, timeout=60).values())).version
            assert version == 2
        shown = cli(env, "status", "-c", str(path))
        assert shown.returncode == 0, shown.stdout + shown.stderr
        for expected in ("job: RUNNING", f"HTTP bridge: ready on {url}"):
            assert expected in shown.stdout, shown.stdout
        assert re.search(r"^input lag: \d+ .*past group ", shown.stdout, re.MULTILINE), shown.stdout  # read over SASL_SSL
        stopped = cli(env, "stop", "-c", str(path))
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        output, _ = start.communicate(timeout=60)
    finally:
        if start.poll() is None:  # a failed assertion: `stop` ends the job and bridge it started too
            cli(env, "stop", "-c", str(path))
            start.wait(60)
    assert start.returncode == 0 and "final savepoint" in output, output
