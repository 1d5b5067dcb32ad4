"""ONNX-level clean-ups applied before the Relax import.

Rewrites here keep the model's meaning exactly; they exist where an exported pattern is easier to
fix in ONNX than in Relax.
"""

import math

import onnx
from onnx import helper

# Shapes, axes, indices, scales and clip bounds are this small; weights are larger. The importer
# binds initializers up to the same size as IR constants after the import.
MAX_CONSTANT_ELEMENTS = 64


def rewrite_onnx_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """Return a copy of `model` ready for the importer; the caller's model is not changed."""
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    small_initializers_to_constants(rewritten.graph)
    return rewritten


def small_initializers_to_constants(graph: onnx.GraphProto) -> None:
    """Turn initializers of at most MAX_CONSTANT_ELEMENTS elements into Constant nodes.

    TVM's converters fold shape arithmetic at import time (Shape → Gather → Concat → Reshape
    becomes a symbolic shape) only when indices, axes and shape pieces are constants. PyTorch's
    TorchScript exporter writes them as Constant nodes, the dynamo exporter as initializers, which
    the importer makes function parameters: the folding stops, and every later op loses its
    shape. Initializers that are also graph inputs may be overridden by the caller, and those kept
    in an external file are read by the importer, so both stay.
    """
    overridable = {value_info.name for value_info in graph.input}
    kept, constants = [], []
    for initializer in graph.initializer:
        if (initializer.name in overridable or math.prod(initializer.dims) > MAX_CONSTANT_ELEMENTS
                or initializer.data_location == onnx.TensorProto.EXTERNAL):
            kept.append(initializer)
        else:
            constants.append(helper.make_node("Constant", [], [initializer.name], value=initializer,
                                              name=f"{initializer.name}::constant"))
    if not constants:
        return
    nodes = constants + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.initializer[:]
    graph.initializer.extend(kept)
