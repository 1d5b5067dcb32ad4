"""NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss, compared with onnxruntime."""

import numpy as np
import pytest
from onnx import TensorProto, helper

import tightfit
from tightfit.errors import InputError
from tightfit.feeds import run_onnxruntime


def loss_model(op, with_weight, outputs, **attributes):
    inputs = ["x", "target"] + (["weight"] if with_weight else [])
    graph = helper.make_graph(
        [helper.make_node(op, inputs, [name for name, _ in outputs], **attributes)], "loss",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5, 2]),
         helper.make_tensor_value_info("target", TensorProto.INT64, [3, 2]),
         helper.make_tensor_value_info("weight", TensorProto.FLOAT, [5])][:len(inputs)],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def check(onnx_model):
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((3, 5, 2)).astype(np.float32),
             "target": np.array([[0, 4], [2, -1], [-1, 3]], np.int64),
             "weight": rng.uniform(0.5, 2, 5).astype(np.float32)}
    feeds = {name: feeds[name] for name in [i.name for i in onnx_model.graph.input]}
    ours = tightfit.compile(onnx_model).session().run(feeds)
    for name, expected in run_onnxruntime(onnx_model, feeds).items():
        assert ours[name].shape == expected.shape, name
        np.testing.assert_allclose(ours[name], expected, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("with_weight", [False, True])
def test_negative_log_likelihood_skips_the_ignored_index(reduction, with_weight):
    shape = [3, 2] if reduction == "none" else []
    check(loss_model("NegativeLogLikelihoodLoss", with_weight, [("loss", shape)],
                     reduction=reduction, ignore_index=-1))


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_softmax_cross_entropy_returns_loss_and_log_probabilities(reduction):
    shape = [3, 2] if reduction == "none" else []
    check(loss_model("SoftmaxCrossEntropyLoss", True, [("loss", shape), ("log_prob", [3, 5, 2])],
                     reduction=reduction, ignore_index=-1))


@pytest.mark.parametrize("op", ["NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss"])
def test_a_target_outside_the_classes_raises_where_onnxruntime_does(op):
    outputs = [("loss", [])] + ([("log_prob", [3, 5, 2])] if op == "SoftmaxCrossEntropyLoss" else [])
    onnx_model = loss_model(op, True, outputs, reduction="mean", ignore_index=-1)
    onnx_model.graph.node[0].name = "loss"
    feeds = {"x": np.zeros((3, 5, 2), np.float32), "target": np.array([[0, 4], [2, -1], [5, 3]]),
             "weight": np.ones(5, np.float32)}
    with pytest.raises(Exception):  # onnxruntime's own error
        run_onnxruntime(onnx_model, feeds)
    with pytest.raises(InputError, match=f"{op} node loss: index 5 is out of range for a dim of 5"):
        tightfit.compile(onnx_model).session().run(feeds)
