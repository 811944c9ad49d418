"""Every request body of the BigDL programming guide's RESTful API section, sent as it is printed
there to a running bridge + job + broker, against a model built for it; each answer is checked
against ONNX Runtime run directly on the same values."""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

from cluster_serving.config import load_config
from cluster_serving.ops.children import EmbeddedJob, HttpBridge
from cluster_serving.ops.processes import write_run_config
from tests.conftest import http_call
from tests.forged_images import png_header
from tests.onnx_models import graph_model

STRINGS = ["come", "on", "united"]
COMPOSITE = {
    "intScalar": 12345,
    "floatScalar": 3.14159,
    "stringScalar": "hello, world. hello, arrow.",
    "intTensor": [7756, 9549, 1094, 9808, 4959, 3831, 3926, 6578, 1870, 1741],
    "floatTensor": [0.6804766, 0.30136853, 0.17394465, 0.44770062, 0.20275897, 0.32762378, 0.45966738,
                    0.30405098, 0.62053126, 0.7037923],
    "stringTensor": STRINGS,
    "intTensor2": [[1, 2], [3, 4], [5, 6]],
    "floatTensor2": [[[0.2, 0.3], [0.5, 0.6]], [[0.2, 0.3], [0.5, 0.6]]],
    "stringTensor2": [[[STRINGS] * 4] * 2] * 2,
}
# The guide's sparse example: 4 values in a (100, 10000, 10) tensor, 40 MB once dense in float32.
SPARSE = {"shape": [100, 10000, 10], "data": [0.2, 0.5, 3.45, 6.78], "indices": [[1, 1, 1], [2, 2, 2], [3, 3, 3], [4, 4, 4]]}


def jpeg_b64(seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(24, 24, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG")
    return base64.b64encode(buffer.getvalue()).decode()


def identity_model(path: Path) -> Path:
    """Every input of the composite example comes back as `<name>_out`: exact round trips."""
    kinds = {int: TensorProto.INT64, float: TensorProto.FLOAT, str: TensorProto.STRING}
    inputs = []
    for name, value in COMPOSITE.items():
        array = np.array(value)
        leaf = array.reshape(-1)[0].item() if array.dtype.kind != "U" else ""
        inputs.append((name, kinds[type(leaf)], list(array.shape)))
    nodes = [helper.make_node("Identity", [name], [f"{name}_out"]) for name, _, _ in inputs]
    return graph_model(path, inputs, nodes, [(f"{name}_out", kind, shape) for name, kind, shape in inputs])


def ids_model(path: Path) -> Path:
    weights = numpy_helper.from_array(np.array([[0.5, -1.0, 2.0], [0.25, 1.5, -0.75]], np.float32), "w")
    return graph_model(path, [("ids", TensorProto.FLOAT, [2])], [helper.make_node("MatMul", ["ids", "w"], ["scores"])],
                       [("scores", TensorProto.FLOAT, [3])], (weights,))


def sparse_model(path: Path) -> Path:
    axes = numpy_helper.from_array(np.array([1, 2, 3], np.int64), "axes")
    nodes = [
        helper.make_node("ReduceSum", ["sparseTensor", "axes"], ["sparse_sum"], keepdims=0),
        helper.make_node("Identity", ["intTensor2"], ["int_out"]),
    ]
    return graph_model(path, [("sparseTensor", TensorProto.FLOAT, SPARSE["shape"]), ("intTensor2", TensorProto.INT64, [3, 2])],
                       nodes, [("sparse_sum", TensorProto.FLOAT, []), ("int_out", TensorProto.INT64, [3, 2])], (axes,))


def image_model(path: Path) -> Path:
    """A 3x3 convolution over the (3, 24, 24) float image, then the mean of each output channel."""
    kernel = numpy_helper.from_array(np.random.default_rng(3).normal(size=(4, 3, 3, 3)).astype(np.float32), "kernel")
    nodes = [
        helper.make_node("Conv", ["image", "kernel"], ["features"]),
        helper.make_node("GlobalAveragePool", ["features"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["scores"]),
    ]
    return graph_model(path, [("image", TensorProto.FLOAT, [3, 24, 24])], nodes, [("scores", TensorProto.FLOAT, [4])], (kernel,))


def image_tensor(b64: str) -> np.ndarray:
    """What the config below asks the job for: RGB, CHW, float32 pixel / 255, no resize."""
    pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=np.float32) / 255
    return pixels.transpose(2, 0, 1)


def dense(sparse: dict) -> np.ndarray:
    array = np.zeros(sparse["shape"], np.float32)
    array[tuple(np.array(sparse["indices"]).T)] = sparse["data"]
    return array


@dataclass
class Example:
    build: Callable[[Path], Path]
    body: dict
    feeds: Callable[[], list[dict[str, np.ndarray]]]  # what ONNX Runtime gets, per instance
    config: dict


def composite_feeds() -> list[dict[str, np.ndarray]]:
    """The composite example typed as the identity model declares its inputs."""
    dtypes = {"U": object, "i": np.int64, "f": np.float32}
    return [{name: np.array(value).astype(dtypes[np.array(value).dtype.kind]) for name, value in COMPOSITE.items()}]


IMAGES = [jpeg_b64(1), jpeg_b64(2)]
EXAMPLES = {
    "images": Example(image_model, {"instances": [{"image": IMAGES[0]}, {"image": IMAGES[1]}]},
                      lambda: [{"image": image_tensor(b64)} for b64 in IMAGES],
                      {"preprocess": {"images": {"image": {"layout": "CHW", "dtype": "float32"}}}}),
    "tensors": Example(ids_model, {"instances": [{"ids": [100.0, 88.0]}, {"ids": [100.0, 88.0]}]},
                       lambda: [{"ids": np.array([100.0, 88.0], np.float32)}] * 2, {}),
    "scalars and tensors": Example(identity_model, {"instances": [COMPOSITE]}, composite_feeds, {}),
    "sparse and dense": Example(
        sparse_model, {"instances": [{"sparseTensor": SPARSE, "intTensor2": [[1, 2], [3, 4], [5, 6]]}]},
        lambda: [{"sparseTensor": dense(SPARSE), "intTensor2": np.array([[1, 2], [3, 4], [5, 6]], np.int64)}],
        {"limits": {"max_instance_bytes": 64 << 20}},
    ),
}


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_programming_guide_example(name: str, tmp_path: Path, broker) -> None:
    example = EXAMPLES[name]
    model = example.build(tmp_path / "model.onnx")
    path = write_run_config(tmp_path, model, broker.bootstrap_servers, flink={"checkpoint_interval_ms": 1000}, **example.config)
    job = EmbeddedJob(path, load_config(path).flink.rest_port, log_path=tmp_path / "job.log")
    bridge = HttpBridge(path, log_path=tmp_path / "bridge.log")
    try:
        job.start()
        status, body = http_call(f"{bridge.start().url}/predict", example.body)
    finally:
        bridge.stop()
        job.stop()
    assert status == 200, body
    session = ort.InferenceSession(str(model))
    names = [output.name for output in session.get_outputs()]
    predictions = body["predictions"]
    assert len(predictions) == len(example.body["instances"])
    for feed, prediction in zip(example.feeds(), predictions):
        batch = {key: np.expand_dims(value, 0) for key, value in feed.items()}
        expected = [output[:1].reshape(output.shape[1:]) for output in session.run(None, batch)]  # 0-d stays an array
        got = [prediction] if len(names) == 1 else [prediction[output] for output in names]
        for want, have in zip(expected, got):
            if want.dtype == object:
                assert np.array(have, dtype=object).tolist() == want.tolist()
            else:
                np.testing.assert_allclose(np.array(have, dtype=want.dtype), want, rtol=1e-5, atol=1e-6)


def test_image_bomb_through_the_bridge_is_a_400_and_the_job_keeps_serving(tmp_path: Path, broker) -> None:
    """The 57-byte PNG claiming 20000x20000 pixels that once restarted the job three times and
    took `cluster-serving start` down: now one 400 for its request, and the next one is served."""
    example = EXAMPLES["images"]
    model = example.build(tmp_path / "model.onnx")
    path = write_run_config(tmp_path, model, broker.bootstrap_servers, flink={"checkpoint_interval_ms": 1000}, **example.config)
    job = EmbeddedJob(path, load_config(path).flink.rest_port, log_path=tmp_path / "job.log")
    bridge = HttpBridge(path, log_path=tmp_path / "bridge.log")
    bomb = base64.b64encode(png_header(20000, 20000)).decode()
    try:
        job.start()
        url = bridge.start().url
        refused = http_call(f"{url}/predict", {"instances": [{"image": {"b64": bomb}}]})
        served = http_call(f"{url}/predict", example.body)
        # The REST API lists a job's metrics once it has fetched them, seconds after the job runs.
        deadline = time.monotonic() + 30
        while not (restarts := job.rest(f"/jobs/{job.job_id}/metrics?get=numRestarts")) and time.monotonic() < deadline:
            time.sleep(1)
        history = job.rest(f"/jobs/{job.job_id}/exceptions")["exceptionHistory"]["entries"]
    finally:
        bridge.stop()
        job.stop()
    assert refused[0] == 400 and "20000x20000 pixels, over the limit" in refused[1]["error"], refused
    assert served[0] == 200, served
    assert restarts == [{"id": "numRestarts", "value": "0"}] and not history, history
