"""Every conv algorithm matches onnxruntime on any conv it applies to: channels, groups, kernel
size, strides, asymmetric padding, dilation, bias and map size drawn at random, and the
algorithm forced (PipelineOptions.conv_algorithms; a conv it does not apply to, as Winograd to
a strided one, falls back to the others). The symbolic height and width take two sizes."""

from __future__ import annotations

import numpy as np
import onnx
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import tightfit
from tightfit.feeds import run_onnxruntime
from tightfit.pipeline import PipelineOptions

ALGORITHMS = ("direct", "width_vectors", "im2col", "winograd_f2", "winograd_f4", "depthwise")


@st.composite
def convs(draw):
    groups = draw(st.sampled_from([1, 1, 2, "depthwise"]))
    group_in = draw(st.integers(1, 6))
    if groups == "depthwise":
        groups = draw(st.integers(1, 12))
        group_in, group_out = 1, draw(st.sampled_from([1, 2]))
    else:
        group_out = draw(st.integers(1, 20))
    kernel = (draw(st.integers(1, 5)), draw(st.integers(1, 5)))
    return dict(in_channels=groups * group_in, out_channels=groups * group_out, groups=groups,
                kernel=kernel, strides=(draw(st.integers(1, 3)), draw(st.integers(1, 3))),
                pads=[draw(st.integers(0, 2)) for _ in range(4)],
                dilations=(draw(st.integers(1, 2)), draw(st.integers(1, 2))),
                bias=draw(st.booleans()), batch=draw(st.integers(1, 2)),
                sizes=[(draw(st.integers(1, 20)), draw(st.integers(1, 24))) for _ in range(2)],
                algorithm=draw(st.sampled_from(ALGORITHMS)))


def conv_model(conv: dict) -> onnx.ModelProto:
    rng = np.random.default_rng(5)
    kh, kw = conv["kernel"]
    weight = rng.standard_normal(
        (conv["out_channels"], conv["in_channels"] // conv["groups"], kh, kw)).astype(np.float32)
    initializers = [numpy_helper.from_array(weight, "w")]
    inputs = ["x", "w"]
    if conv["bias"]:
        initializers.append(numpy_helper.from_array(
            rng.standard_normal(conv["out_channels"]).astype(np.float32), "b"))
        inputs.append("b")
    node = helper.make_node("Conv", inputs, ["y"], kernel_shape=[kh, kw], strides=conv["strides"],
                            pads=conv["pads"], dilations=conv["dilations"], group=conv["groups"])
    graph = helper.make_graph(
        [node], "any_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                       [conv["batch"], conv["in_channels"], "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                       [conv["batch"], conv["out_channels"], None, None])],
        initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _out_extent(size: int, kernel: int, stride: int, pad: int, dilation: int) -> int:
    return (size + pad - dilation * (kernel - 1) - 1) // stride + 1


@settings(max_examples=25, deadline=None)
@example(dict(in_channels=3, out_channels=6, groups=3, kernel=(3, 1), strides=(1, 1),
              pads=[0, 0, 0, 0], dilations=(1, 1), bias=False, batch=2, sizes=[(3, 1), (9, 4)],
              algorithm="width_vectors"))  # fusing its outer loops failed (_fuses_at_once)
@example(dict(in_channels=3, out_channels=6, groups=3, kernel=(1, 1), strides=(1, 1),
              pads=[0, 0, 2, 0], dilations=(1, 1), bias=False, batch=2, sizes=[(1, 1), (9, 4)],
              algorithm="width_vectors"))  # its loops fused two at a time failed codegen
@example(dict(in_channels=2, out_channels=2, groups=2, kernel=(1, 1), strides=(2, 1),
              pads=[0, 0, 0, 0], dilations=(1, 1), bias=False, batch=1, sizes=[(1, 1), (9, 4)],
              algorithm="depthwise"))  # input rows between strided windows: an empty update
@example(dict(in_channels=1, out_channels=1, groups=1, kernel=(1, 1), strides=(1, 2),
              pads=[0, 0, 0, 1], dilations=(1, 1), bias=False, batch=2, sizes=[(1, 1), (5, 7)],
              algorithm="im2col"))  # its GEMM over the width expression: LLVM divided by zero
@given(convs())
def test_any_conv_matches_onnxruntime_with_each_algorithm(conv):
    (kh, kw), (sh, sw), (dh, dw) = conv["kernel"], conv["strides"], conv["dilations"]
    top, left, bottom, right = conv["pads"]
    for height, width in conv["sizes"]:
        assume(_out_extent(height, kh, sh, top + bottom, dh) >= 1
               and _out_extent(width, kw, sw, left + right, dw) >= 1)
    model = conv_model(conv)
    options = PipelineOptions(conv_algorithms=(conv["algorithm"],))
    session = tightfit.compile(model, options=options).session()
    for height, width in conv["sizes"]:
        x = np.random.default_rng(height * width).standard_normal(
            (conv["batch"], conv["in_channels"], height, width)).astype(np.float32)
        np.testing.assert_allclose(session.run({"x": x})["y"],
                                   run_onnxruntime(model, {"x": x})["y"], rtol=1e-4, atol=1e-4,
                                   err_msg=f"{conv} at {height}x{width}")

