"""Batch norms after convs disappear into the conv's weight and bias; nothing else changes."""

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

import tightfit
from tightfit.frontend import import_onnx
from tightfit.pipeline import run_pipeline
from tightfit.target import resolve_target


def conv_bn_model(kind: str) -> tuple:
    """x -> Conv (kind) -> BatchNormalization -> outputs; 'shared' also returns the conv output,
    'input_bn' normalizes the input itself (no conv to fold into)."""
    rng = np.random.default_rng(0)
    channels, out_channels = 4, 6
    spatial = {"conv1d": [9], "conv2d": [7, 5], "depthwise": [7, 5], "shared": [7, 5], "input_bn": [7, 5]}[kind]
    groups = channels if kind == "depthwise" else 1
    out_channels = channels if kind in ("depthwise", "input_bn") else out_channels
    kernel = [3] * len(spatial)
    initializers = [
        numpy_helper.from_array(rng.standard_normal([out_channels, channels // groups] + kernel).astype(np.float32), "w"),
        numpy_helper.from_array(rng.standard_normal(out_channels).astype(np.float32), "b"),
        numpy_helper.from_array(rng.uniform(0.5, 2, out_channels).astype(np.float32), "gamma"),
        numpy_helper.from_array(rng.standard_normal(out_channels).astype(np.float32), "beta"),
        numpy_helper.from_array(rng.standard_normal(out_channels).astype(np.float32), "mean"),
        numpy_helper.from_array(rng.uniform(0.1, 3, out_channels).astype(np.float32), "var"),
    ]
    conv = helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1] * 2 * len(spatial), group=groups)
    normalized_input = "x" if kind == "input_bn" else "c"
    nodes = ([] if kind == "input_bn" else [conv]) + [
        helper.make_node("BatchNormalization", [normalized_input, "gamma", "beta", "mean", "var"], ["y"],
                         epsilon=1e-3)]
    out_shape = ["n", out_channels] + spatial  # 3-wide kernels with one pixel of padding keep the size
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)]
    if kind == "shared":
        outputs.append(helper.make_tensor_value_info("c", TensorProto.FLOAT, out_shape))
    graph = helper.make_graph(nodes, kind, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", channels] + spatial)],
                              outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), [2, channels] + spatial


@pytest.mark.parametrize("kind, folded", [("conv1d", True), ("conv2d", True), ("depthwise", True),
                                          ("shared", False), ("input_bn", False)])
def test_batch_norm_after_a_conv_is_folded_and_outputs_match_onnxruntime(kind, folded):
    model, shape = conv_bn_model(kind)
    mod, _ = run_pipeline(import_onnx(model).mod, resolve_target("host"), stop_after="tightfit.FoldBatchNorm")
    assert ("batch_norm" not in mod.script()) == folded
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    expected = onnxruntime.InferenceSession(model.SerializeToString()).run(None, {"x": x})
    outputs = tightfit.compile(model).session().run({"x": x})
    for value, reference in zip(outputs.values(), expected):
        np.testing.assert_allclose(value, reference, rtol=1e-4, atol=1e-4)
