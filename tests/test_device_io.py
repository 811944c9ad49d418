"""The path a batch takes to a GPU, run on the CPU provider (which accepts bound inputs too): rows
written into reused host buffers and bound (device_io.BoundRunner), and image normalisation as
nodes in front of the model (rewrites). Each must give what the host path gives."""

from __future__ import annotations

import base64
import io
import logging
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper
from PIL import Image

import cluster_serving.runtime
from cluster_serving.config import ImageConfig, LimitsConfig, load_config
from cluster_serving.ops.sample_model import FEATURES, build_sample_model
from cluster_serving.runtime.decode import prepare_instances
from cluster_serving.runtime.frames import read_result_frame, write_batch_frame, write_control_frame
from cluster_serving.runtime.device_io import COPY_THREADS, PARALLEL_COPY_BYTES, SharedExclusiveLock
from cluster_serving.runtime.infer import predict
from cluster_serving.runtime.model import OnnxModel
from cluster_serving.runtime.outcomes import as_messages
from cluster_serving.runtime.preprocess import decode_image
from cluster_serving.runtime.repository import RoutingTable, scan
from cluster_serving.runtime.serve import BatchServer
from cluster_serving.runtime.servables import InstancePool
from cluster_serving.wire.codec import decode_message
from cluster_serving.wire.inputs import encode_request
from tests.onnx_models import graph_model

LIMITS = LimitsConfig(max_instance_bytes=1 << 20, max_image_pixels=1 << 20)


@pytest.fixture(scope="module")
def sample_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sample_model(tmp_path_factory.mktemp("bound") / "sample.onnx")


def test_bound_runs_give_what_plain_runs_give(sample_path: Path) -> None:
    """Batches of rows scattered in memory, smaller and larger than the one before (the buffer is
    reused, then grown), float64 rows cast into the float32 buffer, and runs of 2."""
    bound, plain = OnnxModel(sample_path, "cpu", on_device=True), OnnxModel(sample_path, "cpu", on_device=False)
    assert bound.runner is not None and plain.runner is None
    rng = np.random.default_rng(5)
    for count, dtype, run_size in ((6, np.float32, 0), (3, np.float32, 0), (11, np.float64, 0), (7, np.float32, 2)):
        scattered = rng.normal(size=(count, FEATURES + 3)).astype(dtype)
        feeds = [{"features": row[1:FEATURES + 1]} for row in scattered]
        got, want = bound.run_stacked(feeds, run_size), plain.run_stacked(feeds, run_size)
        assert got.keys() == want.keys()
        for name in want:
            assert got[name].shape[0] == count
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7)
    assert len(bound.runner.staging["features"].array) == 11  # grown once, to the largest batch


def test_a_large_batch_is_copied_into_place_by_several_threads(tmp_path: Path) -> None:
    """Rows of 602 KB, over PARALLEL_COPY_BYTES together: each lands in its own row, in order."""
    shape = [3, 224, 224]
    path = graph_model(tmp_path / "large.onnx", [("x", TensorProto.FLOAT, shape)], [helper.make_node("Identity", ["x"], ["y"])],
                       [("y", TensorProto.FLOAT, shape)])
    model = OnnxModel(path, "cpu", on_device=True)
    frame = np.random.default_rng(2).random(13 * 150528 + 5, dtype=np.float32)
    rows = [frame[5 + i * 150528:5 + (i + 1) * 150528].reshape(shape) for i in range(13)]
    assert 13 * rows[0].nbytes >= PARALLEL_COPY_BYTES and COPY_THREADS > 1
    np.testing.assert_array_equal(model.run_stacked([{"x": row} for row in rows])["y"], np.stack(rows))


def identity_model(path: Path, layout: str, dtype: int) -> Path:
    """Its input as its output: what the nodes in front of it make of the pixels, to compare."""
    shape = [3, 6, 8] if layout == "CHW" else [6, 8, 3]
    return graph_model(path, [("x", dtype, shape)], [helper.make_node("Identity", ["x"], ["y"])], [("y", dtype, shape)])


def image_request(uri: str, data: bytes) -> bytes:
    return encode_request(uri, {"x": {"b64": base64.b64encode(data).decode()}})


def encoded(pixels: np.ndarray, kind: str) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, kind)
    return out.getvalue()


@pytest.mark.parametrize(("layout", "dtype", "onnx_type", "settings"), [
    ("CHW", "float32", TensorProto.FLOAT, {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}),
    ("HWC", "float16", TensorProto.FLOAT16, {"channels": "BGR", "scale": 2.0}),
])
def test_images_normalised_by_nodes_in_front_of_the_model(
    tmp_path: Path, layout: str, dtype: str, onnx_type: int, settings: dict[str, object]
) -> None:
    """The host decodes plain pixels into the runner's buffer, bound as they lie; the model's
    nodes lay them out and normalise them as the host would have; a bad image among good ones
    is that request's error alone."""
    config = ImageConfig(resize=(6, 8), layout=layout, dtype=dtype, **settings)
    path = identity_model(tmp_path / "identity.onnx", layout, onnx_type)
    model = OnnxModel(path, "cpu", images={"x": config}, on_device=True)
    assert model.images["x"] == ImageConfig(channels=config.channels, resize=(6, 8))
    assert model.inputs[0].dtype == np.uint8 and model.inputs[0].shape[1:] == (6, 8, 3)
    rng = np.random.default_rng(9)
    photos = [encoded(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8), kind) for kind in ("JPEG", "PNG", "JPEG")]
    datas = [photos[0], b"\xff\xd8\xff" + b"\x00" * 64, photos[1], photos[2]]
    instances = [decode_message(image_request(f"r{i}", data), 1 << 20) for i, data in enumerate(datas)]
    with ThreadPoolExecutor(2) as pool:
        ready, errors = prepare_instances(instances, model.images, LIMITS, pool, model.batch_array)
        results = {message.uri: message for message in as_messages(predict(model, ready))}
    assert [message.uri for message in errors] == ["r1"] and errors[0].error.startswith("invalid input: image 'x' does not decode")
    assert "x" not in model.runner.staging  # the decoded rows were bound where they lay
    for uri, data in (("r0", photos[0]), ("r2", photos[1]), ("r3", photos[2])):
        want = decode_image("x", data, config, 1 << 20)
        np.testing.assert_allclose(results[uri].tensors["y"], want, rtol=1e-3 if dtype == "float16" else 1e-6)


def test_without_onnx_the_host_keeps_normalising(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """rewrites needs the onnx package: a runtime without it serves the same images, normalised
    on the host, and says so once in the log."""
    monkeypatch.setitem(sys.modules, "cluster_serving.runtime.rewrites", None)  # its import fails
    monkeypatch.delattr(cluster_serving.runtime, "rewrites", raising=False)
    config = ImageConfig(resize=(6, 8), layout="CHW", dtype="float32", mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.5))
    with caplog.at_level(logging.WARNING, logger="cluster_serving.runtime"):  # tests/fuzz quiets it
        model = OnnxModel(identity_model(tmp_path / "identity.onnx", "CHW", TensorProto.FLOAT), "cpu", images={"x": config}, on_device=True)
    assert model.images["x"] == config and model.inputs[0].dtype == np.float32 and model.runner is not None
    assert "images stay normalised on the host" in caplog.text
    photo = encoded(np.random.default_rng(4).integers(0, 256, (6, 8, 3), dtype=np.uint8), "PNG")
    ready, errors = prepare_instances([decode_message(image_request("r0", photo), 1 << 20)], model.images, LIMITS, None, model.batch_array)
    [result] = as_messages(predict(model, ready))
    assert not errors
    np.testing.assert_allclose(result.tensors["y"], decode_image("x", photo, config, 1 << 20), rtol=1e-6)


def test_float16_serves_float32_requests_close_to_float32_results(sample_path: Path) -> None:
    """model.float16: the job converts the model as it opens it; requests and results keep their
    float32 form, and the results move only in the low digits."""
    config = load_config(overrides={"model.path": str(sample_path), "model.float16": True})
    server = BatchServer(config)
    server.serve_frame(write_control_frame(RoutingTable.of(scan(config)).text()))
    rows = np.random.default_rng(8).normal(size=(6, FEATURES)).astype(np.float32)
    records = [(f"r{i}", encode_request(f"r{i}", {"features": row})) for i, row in enumerate(rows)]
    results = {uri: decode_message(bytes(payload), 1 << 20) for uri, payload in read_result_frame(server.serve_frame(write_batch_frame("", "", records)))}
    want = OnnxModel(sample_path, "cpu").run_stacked([{"features": row} for row in rows])
    for name, expected in want.items():
        got = np.stack([results[f"r{i}"].tensors[name] for i in range(6)])
        assert got.dtype == expected.dtype == np.float32 and not np.array_equal(got, expected)  # float16 arithmetic
        np.testing.assert_allclose(got, expected, rtol=2e-2, atol=2e-3)
    server.close()


def test_float16_and_pixel_nodes_together(tmp_path: Path) -> None:
    config = ImageConfig(resize=(6, 8), layout="CHW", dtype="float32", mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.5))
    path = identity_model(tmp_path / "identity.onnx", "CHW", TensorProto.FLOAT)
    model = OnnxModel(path, "cpu", images={"x": config}, on_device=True, float16=True)
    assert model.inputs[0].dtype == np.uint8
    photo = encoded(np.random.default_rng(6).integers(0, 256, (6, 8, 3), dtype=np.uint8), "PNG")
    ready, _ = prepare_instances([decode_message(image_request("r0", photo), 1 << 20)], model.images, LIMITS, None, model.batch_array)
    [result] = as_messages(predict(model, ready))
    np.testing.assert_allclose(result.tensors["y"], decode_image("x", photo, config, 1 << 20), rtol=2e-3, atol=2e-3)


def test_full_batches_replay_from_buffers_bound_once(sample_path: Path) -> None:
    """model.cuda_graph: batches of the graph's rows run from inputs and outputs bound once (on
    CUDA a replayed graph; the CPU provider runs them as they are), each with its own rows and
    results; other batches run as before."""
    graphed = OnnxModel(sample_path, "cpu", on_device=True, graph_rows=4)
    plain = OnnxModel(sample_path, "cpu")
    rng = np.random.default_rng(12)
    for count, dtype in ((4, np.float32), (3, np.float32), (4, np.float64), (4, np.float32), (9, np.float32)):
        rows = rng.normal(size=(count, FEATURES)).astype(dtype)
        feeds = [{"features": row} for row in rows]
        got, want = graphed.run_stacked(feeds), plain.run_stacked(feeds)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7)
        if count == 4:
            graph = graphed.runner.graph
            assert graph is not None and graph.signature == (("features", (4, FEATURES), np.dtype(np.float32)),)
            bound = graph.inputs["features"].data_ptr()
    assert graphed.runner.graph is graph and graph.inputs["features"].data_ptr() == bound  # bound once, reused


def test_cuda_graph_serves_full_and_partial_batches(sample_path: Path) -> None:
    """The config key reaches the model's copies: a full batch and a partial one, served."""
    config = load_config(overrides={"model.path": str(sample_path), "model.cuda_graph": True, "batching.batch_size": 4})
    server = BatchServer(config)
    server.serve_frame(write_control_frame(RoutingTable.of(scan(config)).text()))
    rows = np.random.default_rng(13).normal(size=(6, FEATURES)).astype(np.float32)
    want = OnnxModel(sample_path, "cpu").run_stacked([{"features": row} for row in rows])
    for batch in (range(4), range(4, 6)):
        records = [(f"r{i}", encode_request(f"r{i}", {"features": rows[i]})) for i in batch]
        results = {uri: decode_message(bytes(payload), 1 << 20) for uri, payload in read_result_frame(server.serve_frame(write_batch_frame("", "", records)))}
        for i in batch:
            for name, expected in want.items():
                np.testing.assert_allclose(results[f"r{i}"].tensors[name], expected[i], rtol=1e-6, atol=1e-7)
    server.close()


def test_recording_runs_alone() -> None:
    """A thread that asks to hold the lock alone waits for those sharing it and keeps newcomers
    out until it is done; sharers hold it together."""
    lock = SharedExclusiveLock()
    order: list[str] = []
    first_in, release_first = threading.Event(), threading.Event()

    def sharer(name: str, hold: threading.Event | None = None) -> None:
        with lock.shared():
            order.append(f"{name} in")
            if hold is not None:
                first_in.set()
                hold.wait(5)
            order.append(f"{name} out")

    def alone() -> None:
        with lock.exclusive():
            order.append("alone")

    first = threading.Thread(target=sharer, args=("a", release_first))
    first.start()
    assert first_in.wait(5)
    with lock.shared():  # sharers hold it together
        order.append("b")
    recorder = threading.Thread(target=alone)
    recorder.start()
    while not lock.waiting_alone:
        time.sleep(0.001)
    late = threading.Thread(target=sharer, args=("c",))
    late.start()
    time.sleep(0.05)
    assert order == ["a in", "b"]  # the recorder waits for a; c waits behind the recorder
    release_first.set()
    for thread in (first, recorder, late):
        thread.join(5)
    assert order == ["a in", "b", "a out", "alone", "c in", "c out"]


def test_copies_side_by_side_copy_their_rows_on_their_own_thread(tmp_path: Path) -> None:
    """A model served by one copy splits a large batch's copy into place among COPY_THREADS;
    copies side by side (an InstancePool of several) each copy on the lane's own thread."""
    shape = [3, 224, 224]
    path = graph_model(tmp_path / "large.onnx", [("x", TensorProto.FLOAT, shape)], [helper.make_node("Identity", ["x"], ["y"])],
                       [("y", TensorProto.FLOAT, shape)])
    alone = InstancePool([OnnxModel(path, "cpu", on_device=True)], 1)
    side_by_side = InstancePool([OnnxModel(path, "cpu", on_device=True) for _ in range(2)], 2)
    assert alone.first.runner.copy_threads == COPY_THREADS and [copy.runner.copy_threads for copy in side_by_side.copies] == [1, 1]
    rows = list(np.random.default_rng(3).random((13, *shape), dtype=np.float32))
    for copy in side_by_side.copies:
        np.testing.assert_array_equal(copy.run_stacked([{"x": row} for row in rows])["y"], np.stack(rows))
