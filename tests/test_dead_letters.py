"""Dead letters and deadlines on the serving path: a batch as the JVM frames it (BatchFrames.java,
with where each request was read and its headers), served by a BatchServer, and the records the
JVM makes of its results frame. Every request that fails is a dead letter as it came (key, value,
headers) with headers saying why and where it was read; a request whose deadline has passed is
answered deadline_exceeded and never reaches the model. The same through Kafka and Flink, after
a SIGKILL under exactly-once, is in test_recovery.py; through a running job, in
test_deadlines_in_a_job below."""

from __future__ import annotations

import time

import numpy as np
import pytest

from cluster_serving.client import InputQueue, OutputQueue
from cluster_serving.config import load_config
from cluster_serving.kafka.admin import topic_records
from cluster_serving.ops.sample_model import FEATURES, build_sample_model
from cluster_serving.runtime.decode import decode_frame
from cluster_serving.runtime.frames import read_frame, write_control_frame, write_headers
from cluster_serving.runtime.repository import RoutingTable, scan
from cluster_serving.runtime.serve import BatchServer
from cluster_serving.wire.codec import MAX_URI_CHARS, Message, decode_message, encode_message
from tests.conftest import collect
from tests.test_alike_batches import jvm, requests  # noqa: F401  (jvm: a fixture)

SOURCE_TOPIC = "requests-in"
LATE, FRESH = 200, 40


def java_requests(gateway, records: list[tuple[str | None, bytes, bytes | None]], partition: int = 3, first: int = 100):
    """Request rows as the Kafka source makes them: read at `partition`, offsets from `first`,
    each with its header block (or None)."""
    rows = gateway.jvm.java.util.ArrayList()
    for i, (uri, payload, headers) in enumerate(records):
        fields = gateway.new_array(gateway.jvm.Object, 8)
        fields[0], fields[1], fields[4] = uri, bytearray(payload), False
        fields[5], fields[6] = partition, first + i
        fields[7] = None if headers is None else bytearray(headers)
        rows.add(gateway.jvm.org.apache.flink.types.Row.of(fields))
    return rows


def jvm_frame(gateway, records, route=("", "")) -> bytes:
    return bytes(gateway.jvm.clusterserving.flink.BatchFrames.encodeBatch(
        *route, java_requests(gateway, records), MAX_URI_CHARS, 1 << 20))


def jvm_records(gateway, results: bytes) -> tuple[dict[str, Message], list[tuple[str | None, bytes, dict[str, bytes]]]]:
    """What the sink gets of a results frame: results by uri, and dead letters (key, value, headers)."""
    rows = gateway.jvm.clusterserving.flink.BatchFrames.decode(bytearray(results))
    schema = gateway.jvm.clusterserving.flink.ResultRecordSerializationSchema("results", "dead-letters")
    found, letters = {}, []
    for row in rows:
        record = schema.serialize(row, None, None)
        key = None if record.key() is None else bytes(record.key()).decode()
        if record.topic() == "results":
            found[key] = decode_message(bytes(record.value()), 1 << 20)
        else:
            assert record.topic() == "dead-letters"
            headers = {header.key(): header.value() and bytes(header.value()) for header in record.headers().toArray()}
            letters.append((key, bytes(record.value()), headers))
    return found, letters


def server_of(tmp_path_factory: pytest.TempPathFactory, **kafka) -> BatchServer:
    path = build_sample_model(tmp_path_factory.mktemp("letters") / "model.onnx")
    config = load_config(overrides={"model.path": str(path), "kafka.input_topic": SOURCE_TOPIC,
                                    **{f"kafka.{key}": value for key, value in kafka.items()}})
    server = BatchServer(config)
    server.serve_frame(write_control_frame(RoutingTable.of(scan(config)).text()))
    return server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    server = server_of(tmp_path_factory)
    yield server
    server.close()


def deadline_in(seconds: float) -> bytes:
    return write_headers([("deadline-ms", str(int((time.time() + seconds) * 1000)).encode())])


def test_each_failed_request_is_a_dead_letter_as_it_came(jvm, server: BatchServer) -> None:  # noqa: F811
    good = requests(1)[0]
    wrong_shape = ("wrong-shape", encode_message(Message("wrong-shape", {"features": np.ones(FEATURES + 1, np.float32)})))
    traced = write_headers([("trace-id", b"abc"), ("empty", None)])
    records = [(*good, None), ("garbage", b"\x00not a message", traced), (*wrong_shape, None), (None, b"keyless", None)]
    results, letters = jvm_records(jvm, server.serve_frame(jvm_frame(jvm, records, route=("model", "1"))))
    assert results[good[0]].error is None
    assert (results["garbage"].error_code, results["wrong-shape"].error_code) == ("bad_request", "bad_request")
    assert [(key, value) for key, value, _ in letters] == [
        ("garbage", b"\x00not a message"), (wrong_shape[0], wrong_shape[1]), (None, b"keyless")]
    garbage, shape, keyless = (headers for _, _, headers in letters)
    assert garbage == {
        "model": b"model", "version": b"1", "trace-id": b"abc", "empty": None,
        "cluster-serving-error-code": b"bad_request", "cluster-serving-error": results["garbage"].error.encode(),
        "cluster-serving-source-topic": SOURCE_TOPIC.encode(),
        "cluster-serving-source-partition": b"3", "cluster-serving-source-offset": b"101",
    }
    assert (shape["cluster-serving-model"], shape["cluster-serving-version"]) == (b"model", b"1")  # what refused it
    assert shape["cluster-serving-source-offset"] == b"102"
    assert keyless["cluster-serving-error-code"] == b"bad_request" and keyless["cluster-serving-source-offset"] == b"103"
    assert keyless["cluster-serving-error"].startswith(b"no result can answer it: ")


def test_a_refused_alike_batch_leaves_each_request_as_it_came(jvm, server: BatchServer) -> None:  # noqa: F811
    records = requests(3, dtype=np.int32)
    frame = jvm_frame(jvm, [(uri, payload, None) for uri, payload in records])
    assert read_frame(frame).alike is not None
    results, letters = jvm_records(jvm, server.serve_frame(frame))
    assert {uri: result.error_code for uri, result in results.items()} == {uri: "bad_request" for uri, _ in records}
    assert [(key, value) for key, value, _ in letters] == records
    assert [headers["cluster-serving-source-offset"] for _, _, headers in letters] == [b"100", b"101", b"102"]


def test_an_unknown_model_is_a_dead_letter_with_its_code(jvm, server: BatchServer) -> None:  # noqa: F811
    records = [(uri, payload, None) for uri, payload in requests(2)]
    results, letters = jvm_records(jvm, server.serve_frame(jvm_frame(jvm, records, route=("nope", ""))))
    assert {result.error_code for result in results.values()} == {"unknown_model"}
    assert [(headers["model"], headers["cluster-serving-error-code"]) for _, _, headers in letters] == [(b"nope", b"unknown_model")] * 2


def test_dead_letters_can_be_turned_off(jvm, tmp_path_factory: pytest.TempPathFactory) -> None:  # noqa: F811
    server = server_of(tmp_path_factory, dead_letter_topic="")
    try:
        results, letters = jvm_records(jvm, server.serve_frame(jvm_frame(jvm, [("garbage", b"\x00", None)])))
    finally:
        server.close()
    assert results["garbage"].error_code == "bad_request" and letters == []


def test_a_request_past_its_deadline_is_answered_without_running(jvm, server: BatchServer) -> None:  # noqa: F811
    fresh, late, bad_deadline = requests(3)
    records = [(*fresh, deadline_in(60)), (*late, deadline_in(-1)), (*bad_deadline, write_headers([("deadline-ms", b"soon")]))]
    frame = jvm_frame(jvm, records)
    assert read_frame(frame).alike is None  # requests with headers go the per-request way
    batch = decode_frame(frame, server.config.limits)
    assert (len(batch.instances), batch.expired) == (1, 1)
    outcomes, stats = server.serve_batch(batch)
    assert stats.size == 1  # the model ran the fresh one alone
    results, letters = jvm_records(jvm, server.serve_frame(frame))
    assert results[fresh[0]].error is None and results[fresh[0]].batch_size == 1
    assert results[late[0]].error_code == "deadline_exceeded"
    assert results[late[0]].error.startswith("deadline exceeded: the deadline passed ")
    assert results[bad_deadline[0]].error_code == "bad_request" and "deadline-ms" in results[bad_deadline[0]].error
    assert [(key, headers["cluster-serving-error-code"]) for key, _, headers in letters] == [
        (late[0], b"deadline_exceeded"), (bad_deadline[0], b"bad_request")]


def test_a_batch_all_past_its_deadline_runs_no_model(jvm, server: BatchServer) -> None:  # noqa: F811
    batch = decode_frame(jvm_frame(jvm, [(uri, payload, deadline_in(-5)) for uri, payload in requests(4)]), server.config.limits)
    outcomes, stats = server.serve_batch(batch)
    assert stats is None and batch.expired == 4
    assert [outcome.error_code for outcome in outcomes] == ["deadline_exceeded"] * 4


def test_deadlines_in_a_job(write_config, start_job) -> None:
    """Requests enqueued with a timeout that passes before the job starts: each is answered
    deadline_exceeded and left on the dead-letter topic, and the model runs only the others, as
    the job's metrics count them."""
    path, config = write_config()
    kafka = config.kafka
    late, fresh = features(LATE, seed=1), features(FRESH, seed=2)
    with InputQueue(kafka.bootstrap_servers, kafka.input_topic) as inputs:
        inputs.enqueue_batch(((f"late-{i}", {"features": row}) for i, row in enumerate(late)), timeout=0.2)
        inputs.enqueue_batch(((f"fresh-{i}", {"features": row}) for i, row in enumerate(fresh)), timeout=600)
    time.sleep(0.5)
    job = start_job(path, config)
    with OutputQueue(kafka.bootstrap_servers, kafka.result_topic, group_id=f"{kafka.group_id}-client") as outputs:
        results = collect(outputs, LATE + FRESH, timeout=60)
    assert {uri: result.error_code for uri, result in results.items()} == (
        {f"late-{i}": "deadline_exceeded" for i in range(LATE)} | {f"fresh-{i}": None for i in range(FRESH)})
    letters = topic_records(kafka.bootstrap_servers, kafka.dead_letters)
    assert sorted(letter.key.decode() for letter in letters) == sorted(f"late-{i}" for i in range(LATE))
    assert all({"deadline-ms", "cluster-serving-error-code"} <= dict(letter.headers).keys() for letter in letters)
    served = f"model.{config.model.name}.version.1.requestsServed"
    counted = job_metrics(job, "requests", "deadlineExceeded", served)
    # By the job's own count: all read, the late ones answered at once, the model ran the fresh ones.
    assert (counted["requests"], counted["deadlineExceeded"], counted[served]) == (str(LATE + FRESH), str(LATE), str(FRESH))


def job_metrics(job, *names: str) -> dict[str, str]:
    """The infer operator's metrics cluster_serving.<name> from Flink's REST API, once all are listed."""
    vertex = job.rest(f"/jobs/{job.job_id}")["vertices"][0]["id"]
    ids = {f"0.infer.cluster_serving.{name}": name for name in names}
    deadline, found = time.monotonic() + 60, {}
    while len(found) < len(ids) and time.monotonic() < deadline:
        found = {ids[metric["id"]]: metric.get("value") for metric in
                 job.rest(f"/jobs/{job.job_id}/vertices/{vertex}/metrics?get={','.join(ids)}") if metric["id"] in ids}
        time.sleep(1)
    return found


def features(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(count, FEATURES)).astype(np.float32)
