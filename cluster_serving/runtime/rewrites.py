"""What the job changes in a model's graph as it opens it: float16 when `model.float16` asks for
it, and image normalisation as nodes in front of the model when its batches go to a GPU.

With the nodes, the job decodes plain pixels (uint8, height x width x channels) and the device
casts, lays out and normalises them as `preprocess.images` says: a quarter of float32's bytes
cross to the device, and the arithmetic runs where the model does. The nodes compute what
`preprocess.lay_out` computes on the host: pixel * (scale / std) - mean / std, in the configured
dtype. Only this module of the runtime needs the onnx package.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import onnx
from onnx import GraphProto, TensorProto, helper, numpy_helper
from onnxruntime.transformers.float16 import convert_float_to_float16

from cluster_serving.config import ImageConfig
from cluster_serving.runtime.preprocess import affine

ONNX_TYPES = {"float16": TensorProto.FLOAT16, "float32": TensorProto.FLOAT, "float64": TensorProto.DOUBLE}


def normalised_in_graph(images: dict[str, ImageConfig]) -> dict[str, ImageConfig]:
    """The image inputs the nodes have work for: those not taken as uint8 HWC pixels already."""
    return {name: config for name, config in images.items() if config.dtype != "uint8" or config.layout != "HWC"}


def pixels_only(config: ImageConfig) -> ImageConfig:
    """How the host decodes an image whose normalisation the graph does: uint8 pixels, HWC."""
    return ImageConfig(channels=config.channels, resize=config.resize)


def load(path: Path) -> onnx.ModelProto:
    return onnx.load(str(path))


def float16(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model computing in float16, by ONNX Runtime's own converter; inputs and outputs keep
    their float32 types, so requests and results do not change form."""
    return convert_float_to_float16(model, keep_io_types=True)


def with_pixel_inputs(model: onnx.ModelProto, images: dict[str, ImageConfig]) -> onnx.ModelProto:
    """A copy of the model with each input of `images` taking uint8 HWC pixels instead."""
    model = copy.deepcopy(model)
    graph = model.graph
    nodes: list[onnx.NodeProto] = []
    for model_input in graph.input:
        if model_input.name not in images:
            continue
        tensor = model_input.type.tensor_type
        inner = f"{model_input.name}/normalised"
        _rename_uses(graph, model_input.name, inner)
        nodes += _normalising_nodes(graph, model_input.name, inner, images[model_input.name], tensor.elem_type)
        dims = list(tensor.shape.dim)
        if images[model_input.name].layout == "CHW" and len(dims) == 4:
            dims = [dims[0], dims[2], dims[3], dims[1]]
        tensor.elem_type = TensorProto.UINT8
        del tensor.shape.dim[:]
        tensor.shape.dim.extend(dims)
    nodes += graph.node
    del graph.node[:]
    graph.node.extend(nodes)
    return model


def _normalising_nodes(graph: GraphProto, pixels: str, out: str, config: ImageConfig, model_type: int) -> list[onnx.NodeProto]:
    """Cast, transpose (CHW), multiply, subtract, and a last cast where the model's dtype is
    another float than the configured one."""
    factor, offset = affine(config)
    step = f"{pixels}/cast"
    nodes = [helper.make_node("Cast", [pixels], [step], to=ONNX_TYPES[config.dtype])]
    if config.layout == "CHW":
        nodes.append(helper.make_node("Transpose", [step], [f"{pixels}/chw"], perm=[0, 3, 1, 2]))
        step = f"{pixels}/chw"
    for operation, value in (("Mul", factor), ("Sub", offset)):
        if value is None:
            continue
        constant = f"{pixels}/{operation.lower()}_by"
        graph.initializer.append(numpy_helper.from_array(np.asarray(value), constant))
        nodes.append(helper.make_node(operation, [step, constant], [f"{pixels}/{operation.lower()}"]))
        step = f"{pixels}/{operation.lower()}"
    nodes.append(helper.make_node("Cast", [step], [out], to=model_type) if model_type != ONNX_TYPES[config.dtype]
                 else helper.make_node("Identity", [step], [out]))
    return nodes


def _rename_uses(graph: GraphProto, old: str, new: str) -> None:
    """Every node reading `old`, in subgraphs too, reads `new` instead."""
    for node in graph.node:
        node.input[:] = [new if name == old else name for name in node.input]
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                _rename_uses(attribute.g, old, new)
            for subgraph in attribute.graphs:
                _rename_uses(subgraph, old, new)
