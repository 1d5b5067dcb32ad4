"""LayerNormalization's Mean/InvStdDev outputs and RMSNormalization over every dim, compared
with onnxruntime."""

import numpy as np
import pytest
from onnx import TensorProto, helper

import tightfit
from tightfit.feeds import run_onnxruntime


def check(nodes, inputs, outputs, feeds, opset):
    graph = helper.make_graph(nodes, "norm",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs])
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    ours = tightfit.compile(onnx_model).session().run(feeds)
    for name, expected in run_onnxruntime(onnx_model, feeds).items():
        assert ours[name].shape == expected.shape, name
        np.testing.assert_allclose(ours[name], expected, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_layer_normalization_gives_mean_and_inverse_deviation(axis):
    rng = np.random.default_rng(axis + 5)
    scale_shape = [2, 3, 4][axis:]
    statistics_shape = [2, 3, 4][:axis % 3] + [1] * len(scale_shape)
    check([helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["y", "mean", "inv_std"], axis=axis)],
          [("x", [2, 3, 4]), ("scale", scale_shape), ("bias", scale_shape)],
          [("y", [2, 3, 4]), ("mean", statistics_shape), ("inv_std", statistics_shape)],
          {"x": rng.standard_normal((2, 3, 4)).astype(np.float32),
           "scale": rng.standard_normal(scale_shape).astype(np.float32),
           "bias": rng.standard_normal(scale_shape).astype(np.float32)}, opset=17)


def test_rms_normalization_over_every_dim():
    rng = np.random.default_rng(3)
    check([helper.make_node("RMSNormalization", ["x", "scale"], ["y"], axis=0)],
          [("x", [3, 4]), ("scale", [3, 4])], [("y", [3, 4])],
          {"x": rng.standard_normal((3, 4)).astype(np.float32),
           "scale": rng.standard_normal((3, 4)).astype(np.float32)}, opset=23)
