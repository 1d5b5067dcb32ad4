"""Elementwise ops whose operand shapes are decided at run time (passes/broadcast_at_run_time.py):
a reduction over run-time axes divided into its input compiles and matches onnxruntime, and
models whose broadcasts RDP resolves keep the plain ops."""

import numpy as np
import pytest
from onnx import TensorProto, helper

import tightfit
from tightfit.feeds import run_onnxruntime
from tightfit.frontend import import_onnx
from tightfit.pipeline import PipelineOptions, run_pipeline
from tightfit.target import resolve_target
from tightfit.testing import zoo


def rms_norm_over_runtime_axes(dims):
    """x / sqrt(mean(x^2 over the axes fed) + eps): the mean's dims are 1 where it reduced and
    x's elsewhere, which only the run decides."""
    nodes = [helper.make_node("Mul", ["x", "x"], ["squared"]),
             helper.make_node("ReduceMean", ["squared", "axes"], ["mean"], keepdims=1),
             helper.make_node("Add", ["mean", "eps"], ["shifted"]),
             helper.make_node("Sqrt", ["shifted"], ["root"]),
             helper.make_node("Div", ["x", "root"], ["y"])]
    graph = helper.make_graph(
        nodes, "rms_norm_over_runtime_axes",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims),
         helper.make_tensor_value_info("axes", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)],
        [helper.make_tensor("eps", TensorProto.FLOAT, [], [1e-5])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("dims", [[3, 4], ["a", "b"]], ids=["static", "symbolic"])
def test_a_reduction_over_runtime_axes_divided_into_its_input_matches_onnxruntime(dims):
    model = rms_norm_over_runtime_axes(dims)
    session = tightfit.compile(model).session()
    rng = np.random.default_rng(0)
    shapes = [(3, 4)] if dims == [3, 4] else [(3, 4), (1, 5), (4, 1)]
    for shape in shapes:
        for axis in (0, 1, -1):
            feeds = {"x": rng.standard_normal(shape).astype(np.float32), "axes": np.array([axis])}
            np.testing.assert_allclose(session.run(feeds)["y"], run_onnxruntime(model, feeds)["y"],
                                       rtol=1e-5, atol=1e-6, err_msg=f"{shape} along {axis}")


@pytest.mark.parametrize("name", ["detector_fpn", "nonzero_gather", "if_different_shapes"])
def test_broadcasts_rdp_resolves_keep_the_plain_op(name):
    mod = import_onnx(zoo.get(name).build()).mod
    passed, _ = run_pipeline(mod, resolve_target("host"), PipelineOptions(),
                             stop_after="tightfit.BroadcastAtRunTime")
    assert not [gv.name_hint for gv in passed.functions if "broadcast_at_run_time" in gv.name_hint]


def test_an_operand_of_lower_rank_broadcasts_at_run_time():
    """mean(x over the axes fed, keepdims) + bias[4]: the bias, one dim short, is broadcast
    against dims only the run decides."""
    nodes = [helper.make_node("ReduceMean", ["x", "axes"], ["mean"], keepdims=1),
             helper.make_node("Add", ["mean", "bias"], ["y"])]
    graph = helper.make_graph(
        nodes, "biased_mean_over_runtime_axes",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4]),
         helper.make_tensor_value_info("axes", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None])],
        [helper.make_tensor("bias", TensorProto.FLOAT, [4], [0.5, -1.0, 2.0, 3.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    session = tightfit.compile(model).session()
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    for axis in (0, 1):
        feeds = {"x": x, "axes": np.array([axis])}
        expected = run_onnxruntime(model, feeds)["y"]
        ours = session.run(feeds)["y"]
        assert ours.shape == expected.shape
        np.testing.assert_allclose(ours, expected, rtol=1e-6, err_msg=f"along {axis}")
