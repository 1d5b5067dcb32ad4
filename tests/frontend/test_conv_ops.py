"""ConvTranspose with an `output_shape` (frontend/ops_conv.py): its pads derived from the wanted
size, as onnxruntime does, and zero rows and columns where the wanted size passes the natural
one."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import tightfit
from tightfit.errors import ConversionError
from tightfit.feeds import run_onnxruntime


def conv_transpose_model(height, width, kernel, strides, output_shape, auto_pad, channels=(2, 3),
                         with_bias=True, seed=0):
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((channels[0], channels[1], *kernel)).astype(np.float32)
    initializers = [numpy_helper.from_array(weight, "w")]
    inputs = ["x", "w"]
    if with_bias:
        initializers.append(numpy_helper.from_array(rng.standard_normal(channels[1]).astype(np.float32), "b"))
        inputs.append("b")
    node = helper.make_node("ConvTranspose", inputs, ["y"], strides=strides, output_shape=output_shape,
                            auto_pad=auto_pad)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels[0], height, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "c", "oh", "ow"])], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@st.composite
def conv_transposes(draw):
    height, width = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    kernel = [draw(st.integers(1, 4)), draw(st.integers(1, 4))]
    strides = [draw(st.integers(1, 3)), draw(st.integers(1, 3))]
    natural = [s * (n - 1) + k for s, n, k in zip(strides, (height, width), kernel)]
    # the wanted size below the natural one (padding), equal, or above it (onnxruntime's zeros)
    output_shape = [draw(st.integers(max(1, size - 3), size + min(stride - 1, 2)))
                    for size, stride in zip(natural, strides)]
    auto_pad = draw(st.sampled_from(["NOTSET", "SAME_UPPER", "SAME_LOWER"]))
    return height, width, kernel, strides, output_shape, auto_pad, draw(st.booleans())


@settings(max_examples=30, deadline=None)
@given(conv_transposes())
def test_conv_transpose_to_an_output_shape_matches_onnxruntime(case):
    height, width, kernel, strides, output_shape, auto_pad, with_bias = case
    model = conv_transpose_model(height, width, kernel, strides, output_shape, auto_pad,
                                 with_bias=with_bias)
    x = np.random.default_rng(1).standard_normal((1, 2, height, width)).astype(np.float32)
    expected = run_onnxruntime(model, {"x": x})["y"]
    result = tightfit.compile(model).session().run({"x": x})["y"]
    assert result.shape == expected.shape == (1, 3, *output_shape)
    np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-5)


def test_an_output_shape_over_a_symbolic_input_is_refused_with_the_reason():
    model = conv_transpose_model(3, 3, [3, 3], [2, 2], [7, 7], "NOTSET")
    model.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "h"
    with pytest.raises(ConversionError, match="static"):
        tightfit.compile(model)
