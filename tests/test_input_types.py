"""Each of the four input types, alone and mixed in one instance, through the real pipeline:
InputQueue -> broker -> embedded PyFlink job -> OutputQueue. Every result is compared with ONNX
Runtime run directly on what the model should have received."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

from cluster_serving.client import InputQueue, OutputQueue, SparseTensor
from cluster_serving.config import load_config
from cluster_serving.ops.processes import write_run_config
from tests.onnx_models import graph_model

WORDS = ["hello", "world", "cluster", "serving"]
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
RNG = np.random.default_rng(11)


def label_encoder(source: str, target: str) -> Any:
    """Strings -> int64 ids (unknown words -> -1): a lookup graph over a string tensor."""
    return helper.make_node(
        "LabelEncoder", [source], [target], domain="ai.onnx.ml",
        keys_strings=WORDS, values_int64s=list(range(1, len(WORDS) + 1)), default_int64=-1,
    )


def axes(name: str, values: list[int]) -> Any:
    return numpy_helper.from_array(np.array(values, np.int64), name)


def string_model(path: Path) -> Path:
    return graph_model(path, [("text", TensorProto.STRING, [3])], [label_encoder("text", "ids")],
                       [("ids", TensorProto.INT64, [3])])


def image_model(path: Path) -> Path:
    kernel = numpy_helper.from_array(RNG.normal(size=(5, 3, 3, 3)).astype(np.float32), "kernel")
    nodes = [
        helper.make_node("Conv", ["image", "kernel"], ["features"]),
        helper.make_node("GlobalAveragePool", ["features"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["scores"]),
    ]
    return graph_model(path, [("image", TensorProto.FLOAT, [3, 16, 16])], nodes, [("scores", TensorProto.FLOAT, [5])], (kernel,))


TENSOR_INPUTS = [
    ("x64", TensorProto.DOUBLE, [3]), ("i32", TensorProto.INT32, [2, 2]), ("flags", TensorProto.BOOL, [3]),
    ("u8", TensorProto.UINT8, [4]), ("half", TensorProto.FLOAT16, [2]), ("count", TensorProto.INT64, []),
]


def tensor_model(path: Path) -> Path:
    """One input per dtype, each rank; each output computed from or equal to its input."""
    two = numpy_helper.from_array(np.array(2.0), "two")
    one = numpy_helper.from_array(np.array(1, np.int32), "one")
    nodes = [
        helper.make_node("Mul", ["x64", "two"], ["x64_out"]),
        helper.make_node("Add", ["i32", "one"], ["i32_out"]),
        helper.make_node("Not", ["flags"], ["flags_out"]),
        *(helper.make_node("Identity", [name], [f"{name}_out"]) for name in ("u8", "half", "count")),
    ]
    outputs = [(f"{name}_out", kind, shape) for name, kind, shape in TENSOR_INPUTS]
    return graph_model(path, TENSOR_INPUTS, nodes, outputs, (two, one))


def sparse_model(path: Path) -> Path:
    nodes = [
        helper.make_node("ReduceSum", ["sparse", "axis2"], ["row_sums"], keepdims=0),
        helper.make_node("Identity", ["sparse"], ["dense"]),
    ]
    return graph_model(path, [("sparse", TensorProto.FLOAT, [5, 10])], nodes,
                       [("row_sums", TensorProto.FLOAT, [5]), ("dense", TensorProto.FLOAT, [5, 10])], (axes("axis2", [2]),))


def mixed_model(path: Path) -> Path:
    nodes = [
        label_encoder("text", "ids"),
        helper.make_node("GlobalAveragePool", ["image"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["channel_means"]),
        helper.make_node("Identity", ["x"], ["x_out"]),
        helper.make_node("ReduceSum", ["sparse", "axes12"], ["sparse_sum"], keepdims=0),
    ]
    inputs = [("text", TensorProto.STRING, [2]), ("image", TensorProto.FLOAT, [3, 8, 8]),
              ("x", TensorProto.FLOAT, [4]), ("sparse", TensorProto.FLOAT, [3, 3])]
    outputs = [("ids", TensorProto.INT64, [2]), ("channel_means", TensorProto.FLOAT, [3]),
               ("x_out", TensorProto.FLOAT, [4]), ("sparse_sum", TensorProto.FLOAT, [])]
    return graph_model(path, inputs, nodes, outputs, (axes("axes12", [1, 2]),))


def encoded_image(height: int, width: int, fmt: str) -> bytes:
    pixels = RNG.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()


def reference_image(data: bytes, size: int, normalise: bool) -> np.ndarray:
    """What the job should make of an image under the configs below: RGB, resized, float32 / 255,
    optionally (x - MEAN) / STD, CHW. Written from PIL and numpy directly, not from job code."""
    image = Image.open(io.BytesIO(data)).convert("RGB").resize((size, size), Image.Resampling.BILINEAR)
    pixels = np.asarray(image, dtype=np.float32) * np.float32(1 / 255)
    if normalise:
        pixels = (pixels - np.array(MEAN, np.float32)) / np.array(STD, np.float32)
    return pixels.transpose(2, 0, 1)


def dense(indices: np.ndarray, values: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    array = np.zeros(shape, values.dtype)
    array[tuple(indices)] = values
    return array


@dataclass
class Request:
    inputs: dict[str, Any]  # what the user passes to enqueue()
    feed: dict[str, np.ndarray]  # what the model must receive, one instance


@dataclass
class Case:
    build: Callable[[Path], Path]
    requests: Callable[[Path], list[Request]]
    config: dict = field(default_factory=dict)


def string_requests(folder: Path) -> list[Request]:
    texts = [["hello", "world", "serving"], ["unknown", "cluster", ""], ["héllo", "world", "wörld"]]
    return [Request({"text": text}, {"text": np.array(text, dtype=object)}) for text in texts]


def image_requests(folder: Path) -> list[Request]:
    jpeg, png = encoded_image(20, 24, "JPEG"), encoded_image(12, 12, "PNG")
    (folder / "photo.jpg").write_bytes(jpeg)
    return [
        Request({"image": {"path": str(folder / "photo.jpg")}}, {"image": reference_image(jpeg, 16, True)}),
        Request({"image": {"b64": base64.b64encode(png).decode()}}, {"image": reference_image(png, 16, True)}),
    ]


def tensor_requests(folder: Path) -> list[Request]:
    requests = []
    for seed in range(3):
        rng = np.random.default_rng(seed)
        feed = {
            "x64": rng.normal(size=3), "i32": rng.integers(-1000, 1000, (2, 2), dtype=np.int32),
            "flags": rng.integers(0, 2, 3).astype(bool), "u8": rng.integers(0, 256, 4, dtype=np.uint8),
            "half": rng.normal(size=2).astype(np.float16), "count": np.array(2**40 + seed, np.int64),
        }
        requests.append(Request(dict(feed), feed))
    return requests


def sparse_requests(folder: Path) -> list[Request]:
    """BigDL's API guide example, the (nnz, rank) SparseTensor form, and an all-zero tensor."""
    guide = [np.array([[0, 1, 4], [0, 2, 5]]), np.array([101, 102, 103], np.float32), np.array([5, 10])]
    coo = SparseTensor(np.array([[4, 9], [0, 0]]), np.array([-1.5, 2.5], np.float32), (5, 10))
    empty = SparseTensor(np.zeros((0, 2), np.int64), np.zeros(0, np.float32), (5, 10))
    return [
        Request({"sparse": guide}, {"sparse": dense(guide[0], guide[1], (5, 10))}),
        Request({"sparse": coo}, {"sparse": dense(coo.indices.T, coo.values, (5, 10))}),
        Request({"sparse": empty}, {"sparse": np.zeros((5, 10), np.float32)}),
    ]


def mixed_requests(folder: Path) -> list[Request]:
    png = encoded_image(10, 9, "PNG")
    sparse = [np.array([[0, 2], [1, 2]]), np.array([3.0, 4.0], np.float32), np.array([3, 3])]
    x = np.array([0.5, -1.0, 2.0, 8.0], np.float32)
    inputs = {"text": ["world", "nope"], "image": {"b64": base64.b64encode(png).decode()}, "x": x, "sparse": sparse}
    feed = {"text": np.array(["world", "nope"], dtype=object), "image": reference_image(png, 8, False), "x": x,
            "sparse": dense(sparse[0], sparse[1], (3, 3))}
    return [Request(inputs, feed)]


CASES = {
    "string": Case(string_model, string_requests),
    "image, top_n": Case(image_model, image_requests, {
        "preprocess": {"images": {"image": {"resize": [16, 16], "layout": "CHW", "dtype": "float32", "mean": MEAN, "std": STD}}},
        "postprocess": {"top_n": 3},
    }),
    "tensor, every dtype": Case(tensor_model, tensor_requests),
    "sparse": Case(sparse_model, sparse_requests),
    "mixed": Case(mixed_model, mixed_requests, {
        "preprocess": {"images": {"image": {"resize": [8, 8], "layout": "CHW", "dtype": "float32"}}},
    }),
}


@pytest.mark.parametrize("name", list(CASES))
def test_input_type_end_to_end(name: str, tmp_path: Path, broker, start_job, capsys: pytest.CaptureFixture[str]) -> None:
    case = CASES[name]
    model = case.build(tmp_path / "model.onnx")
    path = write_run_config(tmp_path, model, broker.bootstrap_servers, flink={"checkpoint_interval_ms": 1000}, **case.config)
    config = load_config(path)
    start_job(path, config)
    requests = case.requests(tmp_path)
    kafka = config.kafka
    with InputQueue(kafka.bootstrap_servers, kafka.input_topic) as inputs, OutputQueue(
        kafka.bootstrap_servers, kafka.result_topic, group_id=f"{kafka.group_id}-client"
    ) as outputs:
        sent = inputs.enqueue_batch(((f"{name}-{i}", request.inputs) for i, request in enumerate(requests)), progress=True)
        assert sent == len(requests)
        assert f"enqueued {sent} requests in " in capsys.readouterr().err
        results = [outputs.query(f"{name}-{i}", timeout=60) for i in range(len(requests))]
    session = ort.InferenceSession(str(model))
    output_names = [output.name for output in session.get_outputs()]
    top_n = case.config.get("postprocess", {}).get("top_n", 0)
    for request, result in zip(requests, results):
        assert result is not None and "error" not in result, result
        batch = {key: np.expand_dims(value, 0) for key, value in request.feed.items()}
        expected = dict(zip(output_names, (output[0] for output in session.run(None, batch))))
        if top_n:
            scores = expected[output_names[0]]
            best = np.argsort(-scores)[:top_n]
            assert list(result) == best.tolist()
            np.testing.assert_allclose(list(result.values()), scores[best], rtol=1e-5)
            continue
        assert sorted(result) == sorted(expected)
        for output, want in expected.items():
            have = result[output]
            assert have.dtype == want.dtype and have.shape == want.shape, output
            if want.dtype.kind == "f":
                np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6)
            else:
                np.testing.assert_array_equal(have, want)
