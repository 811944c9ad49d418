"""The models the benchmark serves, built into its temp folder: the sample classifier, whose
requests are 64 bytes and cost ONNX Runtime about a microsecond, and a small CNN, whose requests
are 48 KiB images, so that moving the bytes, not the model, shows in the serving path's figures."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, partial
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from bench.images import image_settings, photo_jpeg
from cluster_serving.ops.sample_model import CLASSES, FEATURES, build_sample_model, save_graph
from cluster_serving.wire.codec import EncodedImage

CNN_INPUT = "input"
CNN_SHAPE = (3, 64, 64)


@dataclass(frozen=True)
class BenchModel:
    """One model of the run, with the per-model defaults that keep a full run short: a CNN request
    moves 768 times the bytes of an MLP request, so it gets a smaller backlog and fewer HTTP calls."""

    name: str
    description: str
    input_name: str
    instance_shape: tuple[int, ...]
    build: Callable[[Path], Path]
    requests: int
    # HTTP requests as v2 /infer with the binary tensor data extension instead of /predict JSON:
    # what users of image models send (Triton's clients do), a 48 KiB tensor being ~250 KB as JSON text.
    http_binary: bool = False
    # ONNX Runtime's run size within a batch (batching.run_batch_size; 0: the whole batch).
    run_batch_size: int = 0
    # Requests are JPEG images of the input's size, decoded by the job as these preprocess.images
    # settings of its input say, instead of tensors.
    images: dict | None = None

    @cached_property
    def instance_bytes(self) -> int:
        """A request's payload: its tensor's bytes, or its JPEG's on average."""
        if self.images is not None:
            return round(np.mean([len(sample.data) for sample in self.samples(64)]))
        return math.prod(self.instance_shape) * np.dtype(np.float32).itemsize

    def samples(self, count: int) -> np.ndarray | list[EncodedImage]:
        """`count` distinct instances from a fixed seed (requests cycle through them): float32
        tensors, or for an image model JPEGs of that size."""
        rng = np.random.default_rng(0)
        if self.images is not None:
            return [EncodedImage(photo_jpeg(rng.random(self.instance_shape))) for _ in range(count)]
        return rng.normal(size=(count, *self.instance_shape)).astype(np.float32)


def build_cnn(path: Path, seed: int = 7) -> Path:
    """input float32 [batch, 3, 64, 64] -> Conv 3->32 3x3 -> Relu -> Conv 32->128 3x3/2 -> Relu
    -> Conv 128->128 3x3/2 -> Relu -> GlobalAveragePool -> Flatten -> Gemm 128->10 -> Softmax ->
    probabilities [batch, 10]: about 0.16 GFLOP a request, so that the model, not the bytes, sets
    its pace on a small CPU (about 900 requests/s on one core of the dev machine), as an image model would."""
    rng = np.random.default_rng(seed)
    layers = [(CNN_SHAPE[0], 32, 1), (32, 128, 2), (128, 128, 2)]  # in channels, out channels, stride
    weights, nodes, previous = [], [], CNN_INPUT
    for i, (channels_in, channels_out, stride) in enumerate(layers, 1):
        scale = (2.0 / (channels_in * 9)) ** 0.5
        weights += [
            numpy_helper.from_array(rng.normal(0, scale, (channels_out, channels_in, 3, 3)).astype(np.float32), f"conv{i}_w"),
            numpy_helper.from_array(rng.normal(0, 0.1, (channels_out,)).astype(np.float32), f"conv{i}_b"),
        ]
        nodes += [
            helper.make_node("Conv", [previous, f"conv{i}_w", f"conv{i}_b"], [f"conv{i}"],
                             kernel_shape=[3, 3], strides=[stride, stride], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", [f"conv{i}"], [f"relu{i}"]),
        ]
        previous = f"relu{i}"
    weights += [
        numpy_helper.from_array(rng.normal(0, 0.5, (layers[-1][1], CLASSES)).astype(np.float32), "fc_w"),
        numpy_helper.from_array(rng.normal(0, 0.1, (CLASSES,)).astype(np.float32), "fc_b"),
    ]
    nodes += [
        helper.make_node("GlobalAveragePool", [previous], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["flat"], axis=1),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "bench_cnn",
        [helper.make_tensor_value_info(CNN_INPUT, TensorProto.FLOAT, ["batch", *CNN_SHAPE])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", CLASSES])],
        initializer=weights,
    )
    return save_graph(graph, path)


CONV224_SHAPE = (3, 224, 224)


def build_conv224(path: Path, seed: int = 7) -> Path:
    """input float32 [batch, 3, 224, 224] -> one Conv 3->16 5x5/4 -> Relu -> GlobalAveragePool ->
    Gemm 16->10 -> Softmax: an image-sized input with little compute, so that moving and decoding
    the images, not the model, is what the serving path's figures show."""
    rng = np.random.default_rng(seed)
    weights = [
        numpy_helper.from_array(rng.normal(0, 0.1, (16, 3, 5, 5)).astype(np.float32), "conv_w"),
        numpy_helper.from_array(rng.normal(0, 0.1, (16,)).astype(np.float32), "conv_b"),
        numpy_helper.from_array(rng.normal(0, 0.5, (16, CLASSES)).astype(np.float32), "fc_w"),
        numpy_helper.from_array(rng.normal(0, 0.1, (CLASSES,)).astype(np.float32), "fc_b"),
    ]
    nodes = [
        helper.make_node("Conv", ["input", "conv_w", "conv_b"], ["conv"], kernel_shape=[5, 5], strides=[4, 4], pads=[2, 2, 2, 2]),
        helper.make_node("Relu", ["conv"], ["relu"]),
        helper.make_node("GlobalAveragePool", ["relu"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["flat"], axis=1),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1),
    ]
    graph = helper.make_graph(
        nodes, "bench_conv224",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", *CONV224_SHAPE])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", CLASSES])],
        initializer=weights,
    )
    return save_graph(graph, path)


def build_slow(path: Path, batch_ms: float, batch: int = 32) -> Path:
    """The sample classifier's inputs and outputs around a MatMul of two n x n matrices that does
    not depend on the batch's size (scaled by the batch's sum, so that it runs every time): n picked
    so that a batch of `batch` takes about `batch_ms` on one ONNX Runtime thread of this machine."""
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, FEATURES)).astype(np.float32)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    size = 256
    while True:
        graph = slow_graph(size, rng)
        save_graph(graph, path)
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        session.run(None, {"features": x})
        started = time.perf_counter()
        for _ in range(3):
            session.run(None, {"features": x})
        took_ms = (time.perf_counter() - started) / 3 * 1000
        if took_ms >= batch_ms or size >= 4096:
            return path
        size = min(4096, int(size * max(1.1, (batch_ms / took_ms) ** (1 / 3))))


def slow_graph(size: int, rng: np.random.Generator):
    weights = [
        numpy_helper.from_array(rng.normal(0, 0.01, (size, size)).astype(np.float32), "left"),
        numpy_helper.from_array(rng.normal(0, 0.01, (size, size)).astype(np.float32), "right"),
        numpy_helper.from_array(rng.normal(0, 0.5, (FEATURES, CLASSES)).astype(np.float32), "fc_w"),
        numpy_helper.from_array(np.array(1e-30, np.float32), "tiny"),
    ]
    nodes = [
        helper.make_node("ReduceSum", ["features"], ["total"], keepdims=0),
        helper.make_node("Mul", ["left", "total"], ["scaled"]),
        helper.make_node("MatMul", ["scaled", "right"], ["product"]),
        helper.make_node("ReduceMean", ["product"], ["mean"], keepdims=0),
        helper.make_node("Mul", ["mean", "tiny"], ["nothing"]),
        helper.make_node("MatMul", ["features", "fc_w"], ["logits"]),
        helper.make_node("Add", ["logits", "nothing"], ["shifted"]),
        helper.make_node("Softmax", ["shifted"], ["probabilities"], axis=1),
    ]
    return helper.make_graph(
        nodes, "bench_slow",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", FEATURES])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", CLASSES])],
        initializer=weights,
    )


def build_resnet50(path: Path) -> Path:
    """torchvision's ResNet-50 with random weights (none downloaded), exported to ONNX with a free
    batch dimension; needs torch and torchvision, as a GPU machine has them."""
    try:
        import torch
        import torchvision
    except ImportError:
        raise SystemExit("error: --model resnet50 needs torch and torchvision installed") from None
    model = torchvision.models.resnet50(weights=None).eval()
    torch.onnx.export(model, torch.zeros(1, 3, 224, 224), str(path), input_names=["input"], output_names=["logits"],
                      dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, opset_version=17, dynamo=False)
    return path


def bench_models(hidden: int) -> dict[str, BenchModel]:
    """The models by name; `hidden` is the sample classifier's hidden width (--hidden)."""
    return {
        "mlp": BenchModel(
            "mlp", f"sample classifier {FEATURES}->{hidden}->{CLASSES}", "features", (FEATURES,),
            partial(build_sample_model, hidden=hidden),
            requests=200_000,
        ),
        "cnn": BenchModel(
            "cnn", f"CNN {'x'.join(map(str, CNN_SHAPE))} -> conv32 -> conv128/2 -> conv128/2 -> {CLASSES}", CNN_INPUT,
            CNN_SHAPE, build_cnn,
            # The first drain is also the JVM's warm-up before the timed one: with 8,000 it lasted
            # ~8 s, and in the running drain after it the JIT compilers still took 18-20% of a core
            # from ONNX Runtime (drains of 8,000 one after another: 1,078 req/s, then 1,142-1,183).
            requests=16_000, http_binary=True,
            # On this CPU the CNN is fastest per request in runs of 1: a run of 32 goes through 16 MiB
            # of activations, one of 1 stays in the core's 2 MiB cache (raw ORT 1,493-1,549 req/s in
            # runs of 1 or 2, 1,170-1,191 in runs of 32).
            run_batch_size=1,
        ),
        "jpeg": BenchModel(
            "jpeg", f"224x224 JPEG requests -> {'x'.join(map(str, CONV224_SHAPE))} float32 -> one conv16/4 -> {CLASSES}",
            "input", CONV224_SHAPE, build_conv224, requests=8_000,
            images={"input": image_settings(*CONV224_SHAPE[1:])},
        ),
    }
