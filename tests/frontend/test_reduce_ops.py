"""Reductions whose axes are an input computed at run time (frontend/ops_reduce.py) match
onnxruntime, including over a dim of length 0 (the value over an empty set); so does CumSum
along an axis fed at run time, and an axis outside the rank is refused when the model runs."""

import numpy as np
import pytest
from onnx import TensorProto, helper

import tightfit
from tightfit.feeds import run_onnxruntime

REDUCTIONS = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
              "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"]


def runtime_axes_model(op: str, keepdims: int):
    """`op` over x[a, b, c] along the axes fed as an input (so known only at run time)."""
    node = helper.make_node(op, ["x", "axes"], ["y"], keepdims=keepdims)
    rank = 3 if keepdims else 2
    graph = helper.make_graph(
        [node], "runtime_axes",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["a", "b", "c"]),
         helper.make_tensor_value_info("axes", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None] * rank)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("keepdims", [1, 0])
@pytest.mark.parametrize("op", REDUCTIONS)
def test_runtime_axes_reduction_matches_onnxruntime_over_empty_and_full_dims(op, keepdims):
    """One package per op, run along each axis of a 2 x 0 x 4 input (the reduced dim empty, or
    a kept one) and of a 2 x 3 x 4 one; a reduction over the empty dim is the op's value over
    the empty set, which the earlier broadcast-back form read from past the dim."""
    model = runtime_axes_model(op, keepdims)
    session = tightfit.compile(model).session()
    rng = np.random.default_rng(3)
    for shape in [(2, 0, 4), (2, 3, 4)]:
        for axis in (1, -1, 0):
            feeds = {"x": rng.uniform(0.5, 2.0, shape).astype(np.float32),
                     "axes": np.array([axis], np.int64)}
            expected = run_onnxruntime(model, feeds)["y"]
            if op == "ReduceMean" and shape[axis] == 0:
                # ONNX leaves the mean of an empty set undefined: onnxruntime gives 0, tightfit
                # 0 / 0 as numpy does
                expected = np.full_like(expected, np.nan)
            actual = session.run(feeds)["y"]
            assert actual.shape == expected.shape, f"{shape} along {axis}"
            np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{shape} along {axis}")


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin", "ReduceSum"])
def test_runtime_axes_reduction_of_integers_matches_onnxruntime(op):
    """Integers have no infinity, so the empty-set infinity of floats must not reach them: an
    integer model imports (an infinite constant of an integer type did not) and matches
    onnxruntime along each axis."""
    node = helper.make_node(op, ["x", "axes"], ["y"], keepdims=1)
    graph = helper.make_graph(
        [node], "integer_runtime_axes",
        [helper.make_tensor_value_info("x", TensorProto.INT64, ["a", "b"]),
         helper.make_tensor_value_info("axes", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [None, None])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    session = tightfit.compile(model).session()
    for axis in (0, 1):
        feeds = {"x": np.arange(-3, 9, dtype=np.int64).reshape(3, 4),
                 "axes": np.array([axis], np.int64)}
        np.testing.assert_array_equal(session.run(feeds)["y"], run_onnxruntime(model, feeds)["y"])


def test_axes_computed_from_static_shapes_reduce_as_constant_axes():
    """RMSNormalization's function body, inlined: ReduceMean over Range(1, Size(Shape(x))),
    then the divide by its root. The axes are traced to constants (Size of a Shape is the rank),
    so the result keeps static dims and the divide broadcasts at compile time; as run-time axes
    its dims were fresh symbols, and the divide by them could not be compiled."""
    nodes = [helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Size", ["shape"], ["rank"]),
             helper.make_node("Range", ["one", "rank", "one"], ["axes"]),
             helper.make_node("Mul", ["x", "x"], ["squared"]),
             helper.make_node("ReduceMean", ["squared", "axes"], ["mean"], keepdims=1),
             helper.make_node("Sqrt", ["mean"], ["root"]),
             helper.make_node("Div", ["x", "root"], ["y"])]
    graph = helper.make_graph(
        nodes, "inlined_rms_norm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 4])],
        [helper.make_tensor("one", TensorProto.INT64, [], [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x = np.random.default_rng(0).uniform(0.5, 2.0, (2, 3, 4)).astype(np.float32)
    np.testing.assert_allclose(tightfit.compile(model).session().run({"x": x})["y"],
                               run_onnxruntime(model, {"x": x})["y"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_cumsum_along_an_axis_fed_at_run_time_matches_onnxruntime(exclusive, reverse, dtype):
    kind = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(
        [helper.make_node("CumSum", ["x", "axis"], ["y"], exclusive=exclusive, reverse=reverse)], "cumsum",
        [helper.make_tensor_value_info("x", kind, ["a", "b", "c"]),
         helper.make_tensor_value_info("axis", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("y", kind, ["a", "b", "c"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    session = tightfit.compile(model).session()
    x = np.arange(2 * 3 * 4).reshape(2, 3, 4).astype(dtype) - 5
    for axis in range(-3, 3):
        feeds = {"x": x, "axis": np.array(axis, np.int64)}
        np.testing.assert_array_equal(session.run(feeds)["y"], run_onnxruntime(model, feeds)["y"],
                                      err_msg=f"axis {axis}")
    with pytest.raises(tightfit.errors.InputError, match="out of range"):
        session.run({"x": x, "axis": np.array(3, np.int64)})
