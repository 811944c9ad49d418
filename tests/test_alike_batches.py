"""Alike batches (cluster_serving/runtime/frames.py): requests of one format 2 layout are taken apart in
the JVM (BatchFrames.java) and served whole, their results written back as one section that the
JVM makes messages of. The results must be what the per-request way gives, and every request the
JVM cannot vouch for goes the per-request way."""

from __future__ import annotations

import numpy as np
import pytest

from cluster_serving.config import load_config
from cluster_serving.ops.sample_model import FEATURES, build_sample_model
from cluster_serving.runtime.decode import decode_frame
from cluster_serving.runtime.frames import ALIKE, BATCH, read_frame, read_result_frame, write_alike_frame, write_batch_frame, write_control_frame
from cluster_serving.runtime.repository import RoutingTable, scan
from cluster_serving.runtime.serve import BatchServer
from cluster_serving.wire.codec import MAX_URI_CHARS, EncodedImage, Message, decode_message, encode_message

MAX_INSTANCE_BYTES = 1 << 20


@pytest.fixture(scope="module")
def jvm():
    from pyflink.datastream import StreamExecutionEnvironment

    from cluster_serving.config import defaults
    from cluster_serving.jvm import pipeline_jars

    StreamExecutionEnvironment.get_execution_environment().add_jars(
        *(jar.as_uri() for jar in pipeline_jars(defaults().flink)))
    from pyflink.java_gateway import get_gateway

    return get_gateway()


def java_rows(gateway, records: list[tuple[str | None, bytes]]):
    rows = gateway.jvm.java.util.ArrayList()
    for uri, payload in records:
        fields = gateway.new_array(gateway.jvm.Object, 2)
        fields[0], fields[1] = uri, bytearray(payload)
        rows.add(gateway.jvm.org.apache.flink.types.Row.of(fields))
    return rows


def jvm_frame(gateway, records: list[tuple[str | None, bytes]], max_instance_bytes: int = MAX_INSTANCE_BYTES,
              route: tuple[str, str] = ("", "")) -> bytes:
    """The frame the batcher makes of a batch of `records` for `route` (model, version)."""
    return bytes(gateway.jvm.clusterserving.flink.BatchFrames.encodeBatch(
        *route, java_rows(gateway, records), MAX_URI_CHARS, max_instance_bytes))


def jvm_split(gateway, results: bytes) -> list[tuple[str, bytes]]:
    """The result records the JVM makes of a results frame (not its dead letters)."""
    rows = gateway.jvm.clusterserving.flink.BatchFrames.decode(bytearray(results))
    return [(bytes(row.getField(0)).decode(), bytes(row.getField(1))) for row in rows if row.getField(2) is None]


def requests(count: int, seed: int = 0, dtype=np.float32, shape=(FEATURES,)) -> list[tuple[str, bytes]]:
    rows = np.random.default_rng(seed).normal(size=(count, *shape)).astype(dtype)
    return [(f"req-{i}-ü", encode_message(Message(f"req-{i}-ü", {"features": row}))) for i, row in enumerate(rows)]


def test_alike_requests_cross_as_one_block(jvm) -> None:
    records = requests(5)
    frame = read_frame(jvm_frame(jvm, records, route=("m", "2")))
    assert (frame.kind, frame.model, frame.version, frame.records) == (ALIKE, "m", "2", [])
    assert write_alike_frame("m", "2", records) == jvm_frame(jvm, records, route=("m", "2"))  # tests' and tools' copy
    assert list(frame.alike.uris) == [uri for uri, _ in records]
    batch = decode_frame(jvm_frame(jvm, records), load_config().limits)
    assert batch.size == 5 and not batch.instances and not batch.rejected
    stacked = batch.alike.tensors["features"]
    assert stacked.shape == (5, FEATURES) and stacked.dtype == np.float32
    singly = [decode_message(payload, MAX_INSTANCE_BYTES) for _, payload in records]
    np.testing.assert_array_equal(stacked, np.stack([message.tensors["features"] for message in singly]))
    for made, alone in zip(batch.alike.messages(), singly, strict=True):
        assert (made.uri, made.layout_key, made.tensors.keys()) == (alone.uri, alone.layout_key, alone.tensors.keys())
        np.testing.assert_array_equal(made.tensors["features"], alone.tensors["features"])


@pytest.mark.parametrize("change", [
    "another uri in the payload", "no key", "another shape", "format 1", "over the instance limit", "over-long uri",
])
def test_what_the_jvm_cannot_vouch_for_goes_request_by_request(jvm, change: str) -> None:
    records = requests(3)
    uri = records[1][0]
    if change == "another uri in the payload":
        records[1] = (uri, records[0][1])
    elif change == "no key":
        records[1] = (None, records[1][1])
    elif change == "another shape":
        records[1] = requests(1, shape=(FEATURES + 1,))[0]
    elif change == "format 1":
        records[1] = (uri, encode_message(decode_message(records[1][1], MAX_INSTANCE_BYTES), version=1))
    elif change == "over-long uri":
        long_uri, payload = "u" * (MAX_URI_CHARS + 1), records[1][1]
        at = 6 + len(uri.encode())
        records[1] = (long_uri, b"CST2" + len(long_uri).to_bytes(2, "little") + long_uri.encode() + payload[at:])
    frame = jvm_frame(jvm, records, len(records[0][1]) - 1 if change == "over the instance limit" else MAX_INSTANCE_BYTES)
    assert read_frame(frame).kind == BATCH
    if change not in ("over the instance limit", "over-long uri"):  # limits the JVM alone checks
        assert write_alike_frame("", "", records) is None


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    path = build_sample_model(tmp_path_factory.mktemp("alike") / "model.onnx")
    config = load_config(overrides={"model.path": str(path)})
    server = BatchServer(config)
    server.serve_frame(write_control_frame(RoutingTable.of(scan(config)).text()))
    yield server
    server.close()


def results_of(split: list[tuple[str, bytes]]) -> dict[str, Message]:
    return {uri: decode_message(payload, MAX_INSTANCE_BYTES) for uri, payload in split}


def test_results_of_an_alike_batch_are_those_of_the_per_request_way(jvm, server: BatchServer) -> None:
    records = requests(7, seed=3)
    whole = server.serve_frame(jvm_frame(jvm, records))
    split = jvm_split(jvm, whole)
    assert [(uri, bytes(payload)) for uri, payload in read_result_frame(whole)] == split
    alike, singly = results_of(split), results_of(read_result_frame(server.serve_frame(write_batch_frame("", "", records))))
    assert alike.keys() == singly.keys() == {uri for uri, _ in records}
    for uri, result in alike.items():
        assert result.error is None and result.batch_size == 7 and result.model == "model" and result.model_version == 1
        assert result.tensors.keys() == singly[uri].tensors.keys() == {"probabilities"}
        np.testing.assert_array_equal(result.tensors["probabilities"], singly[uri].tensors["probabilities"])


def test_an_alike_batch_the_model_refuses_fails_each_request(jvm, server: BatchServer) -> None:
    results = results_of(jvm_split(jvm, server.serve_frame(jvm_frame(jvm, requests(3, dtype=np.int32)))))
    assert len(results) == 3
    assert all(r.error_code == "bad_request" and "expects float32, got int32" in r.error for r in results.values())


def test_an_alike_batch_of_values_out_of_range_fails_each_request(jvm, server: BatchServer) -> None:
    records = requests(3, dtype=np.float64)
    fine = read_frame(jvm_frame(jvm, records))
    assert fine.kind == ALIKE
    huge = [(uri, encode_message(Message(uri, {"features": np.full(FEATURES, 1e300)}))) for uri, _ in records]
    results = results_of(jvm_split(jvm, server.serve_frame(jvm_frame(jvm, [records[0], *huge[1:]]))))
    assert results[records[0][0]].error is None
    assert [results[uri].error for uri, _ in huge[1:]] == ["invalid input: input 'features': values outside the range of float32"] * 2


def test_a_layout_that_fits_the_model_is_checked_once(jvm, server: BatchServer) -> None:
    """The model remembers a request layout that fits it as it is; one it casts (values checked
    per request) or refuses is checked again with every batch."""
    served, version = server.servables.resolve("", "")
    model = served.pools[version].first
    model.fitting_layouts.clear()
    for dtype in (np.float64, np.int32):
        server.serve_frame(jvm_frame(jvm, requests(2, dtype=dtype)))
    assert not model.fitting_layouts
    records = requests(4, seed=5)
    first = results_of(jvm_split(jvm, server.serve_frame(jvm_frame(jvm, records))))
    assert model.fitting_layouts == {read_frame(jvm_frame(jvm, records)).alike.layout}
    again = results_of(jvm_split(jvm, server.serve_frame(jvm_frame(jvm, records))))
    assert all(result.error is None for result in again.values())
    for uri, result in again.items():
        np.testing.assert_array_equal(result.tensors["probabilities"], first[uri].tensors["probabilities"])


def test_an_alike_batch_whose_layout_does_not_decode_fails_each_request(jvm, server: BatchServer) -> None:
    uri_a, uri_b = "a", "b"
    broken = [(uri, b"CST2" + len(uri).to_bytes(2, "little") + uri.encode() + (3).to_bytes(4, "little") + b"{x}")
              for uri in (uri_a, uri_b)]
    assert read_frame(jvm_frame(jvm, broken)).kind == ALIKE
    results = results_of(jvm_split(jvm, server.serve_frame(jvm_frame(jvm, broken))))
    assert {uri: r.error for uri, r in results.items()} == {uri: "bad request: version 2 layout is not JSON" for uri in "ab"}


def test_images_of_one_size_come_alike_and_are_read_one_by_one(jvm) -> None:
    """The JVM groups format 2 messages by layout and size alone: image requests whose files have
    one size come as an alike batch. Images do not stack; each request is read as it is alone."""
    files = [bytes([i]) * 100 for i in range(3)]
    records = [(f"i{i}", encode_message(Message(f"i{i}", {"image": EncodedImage(data)}))) for i, data in enumerate(files)]
    frame = jvm_frame(jvm, records)
    assert read_frame(frame).kind == ALIKE
    limits = load_config().limits
    batch, alone = decode_frame(frame, limits), decode_frame(write_batch_frame("", "", records), limits)
    assert batch.alike is None and batch.rejected == [] and batch.size == 3
    expected = [(f"i{i}", {"image": EncodedImage(data)}) for i, data in enumerate(files)]
    assert [(m.uri, m.tensors) for m in batch.instances] == [(m.uri, m.tensors) for m in alone.instances] == expected


@pytest.mark.parametrize(("count", "alike", "sizes"), [(5, True, [5]), (2, True, [2]), (5, False, [2, 2, 1])])
def test_requests_due_at_once_go_as_one_frame_when_alike(jvm, count: int, alike: bool, sizes: list[int]) -> None:
    """More than a batch of alike requests due at once (a batch size of 2 here) is one "A" frame,
    its last batch partial; requests that are not alike go as frames of at most batch_size."""
    from py4j.java_gateway import get_field

    records = requests(count) if alike else [(f"raw-{i}", b"x" * (i + 1)) for i in range(count)]
    parts = jvm.jvm.clusterserving.flink.BatchFrames.encodeRoute(
        "", "", java_rows(jvm, records), 2, MAX_URI_CHARS, MAX_INSTANCE_BYTES)
    frames = [read_frame(bytes(get_field(part, "frame"))) for part in parts]
    uris = [list(frame.alike.uris) if frame.alike is not None else [uri for uri, _ in frame.records] for frame in frames]
    assert [len(held) for held in uris] == [get_field(part, "requests").size() for part in parts] == sizes
    assert {frame.kind for frame in frames} == {ALIKE if alike else BATCH}
    assert [uri for held in uris for uri in held] == [uri for uri, _ in records]


def test_a_slice_of_a_uri_block_is_a_block_of_those_uris() -> None:
    """by_batch cuts the rows of joined batches: a slice of a uris block is a block of the same
    uris (any slice a list takes), made without decoding them."""
    from cluster_serving.runtime.frames import UriBlock

    uris = ["a", "bé", "", "c" * 300, "d-4", "e5"]
    block = UriBlock(UriBlock.of(uris).block, len(uris))
    for cut in (slice(0, 4), slice(4, None), slice(None), slice(2, 2), slice(5, 1), slice(-2, None), slice(1, -1), slice(0, 99)):
        part = block[cut]
        assert isinstance(part, UriBlock) and list(part) == uris[cut] and len(part) == len(uris[cut]), cut
        assert bytes(part.block) == UriBlock.of(uris[cut]).block
    assert "_items" not in vars(block), "slicing decoded the block"
    assert block[::2] == uris[::2] and block[-1] == uris[-1]


@pytest.mark.parametrize("batches", [3, 2.5])
def test_a_frame_of_joined_batches_is_served_batch_by_batch(jvm, server: BatchServer, batches: float) -> None:
    """Batches the JVM joined into one frame (job/batch.py), the last one partial or not, run in
    runs of batch_size, and each result says the batch it ran in; the results match the
    per-request way."""
    batch_size = server.config.batching.batch_size
    records = requests(int(batches * batch_size), seed=5)
    model = server.servables.resolve("", "")[0].pools[1].first
    runs = []
    run_columns = model.run_columns
    model.run_columns = lambda tensors, run_size: runs.append(run_size) or run_columns(tensors, run_size)
    try:
        batch = decode_frame(jvm_frame(jvm, records), load_config().limits)
        outcomes, stats = server.serve_batch(batch)
    finally:
        model.run_columns = run_columns
    assert runs == [batch_size] and (stats.size, stats.batches) == (len(records), 3)
    results = results_of(read_result_frame(server.serve_frame(jvm_frame(jvm, records))))
    singly = results_of(read_result_frame(server.serve_frame(write_batch_frame("", "", records))))
    assert results.keys() == singly.keys() == {uri for uri, _ in records}
    last = len(records) - 2 * batch_size
    assert [results[uri].batch_size for uri, _ in records] == [batch_size] * 2 * batch_size + [last] * last
    for uri, result in results.items():
        assert result.error is None
        np.testing.assert_array_equal(result.tensors["probabilities"], singly[uri].tensors["probabilities"])
