"""Split by sizes given at run time, computed from shapes, or into uneven parts, EyeLike of
another type than its input, Trilu by an offset and OneHot of a depth given at run time, and
Constant's scalar and list forms, compared with onnxruntime; AffineGrid of a size given at run
time, compared with onnx's reference."""

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import tightfit
from tightfit.frontend import import_onnx
from tightfit.feeds import run_onnxruntime


def check(nodes, inputs, outputs, feeds, opset=18):
    onnx_model = make_model(nodes, inputs, outputs, opset)
    ours = tightfit.compile(onnx_model).session().run(feeds)
    for name, expected in run_onnxruntime(onnx_model, feeds).items():
        assert ours[name].dtype == expected.dtype, name
        np.testing.assert_array_equal(ours[name], expected, err_msg=name)


def make_model(nodes, inputs, outputs, opset=18):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(*spec) for spec in inputs],
                              [helper.make_tensor_value_info(*spec) for spec in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


F, I64 = TensorProto.FLOAT, TensorProto.INT64


@pytest.mark.parametrize("sizes", [[1, 4, 1], [0, 2, 4]])
def test_split_by_sizes_given_at_run_time(sizes):
    check([helper.make_node("Split", ["x", "sizes"], ["a", "b", "c"], axis=1)],
          [("x", F, [2, 6]), ("sizes", I64, [3])],
          [("a", F, [2, None]), ("b", F, [2, None]), ("c", F, [2, None])],
          {"x": np.arange(12, dtype=np.float32).reshape(2, 6), "sizes": np.array(sizes, np.int64)})


@pytest.mark.parametrize("width", [7, 8])
def test_split_by_sizes_computed_from_the_input_shape_keeps_lengths_known(width):
    """Sizes computed from Shape (the RotaryEmbedding function's split of the head size) give
    parts whose lengths are expressions of the input's dims, not symbols bound at run time."""
    nodes = [helper.make_node("Shape", ["x"], ["width"], start=1, end=2),
             helper.make_node("Constant", [], ["two"], value_ints=[2]),
             helper.make_node("Div", ["width", "two"], ["half"]),
             helper.make_node("Sub", ["width", "half"], ["rest"]),
             helper.make_node("Concat", ["half", "rest"], ["sizes"], axis=0),
             helper.make_node("Split", ["x", "sizes"], ["a", "b"], axis=1)]
    inputs, outputs = [("x", F, ["batch", "w"])], [("a", F, ["batch", None]), ("b", F, ["batch", None])]
    check(nodes, inputs, outputs, {"x": np.arange(2 * width, dtype=np.float32).reshape(2, width)})
    main = import_onnx(make_model(nodes, inputs, outputs)).mod["main"]
    at_width = tvm.sym.Analyzer()
    at_width.bind(main.params[0].ty.shape.values[1], width)
    lengths = [at_width.simplify(part.shape.values[1]) for part in main.ret_ty.fields]
    assert [int(length) for length in lengths] == [width // 2, width - width // 2]


def test_split_into_uneven_parts():
    check([helper.make_node("Split", ["x"], ["a", "b", "c"], axis=0, num_outputs=3)],
          [("x", F, [7])], [("a", F, [3]), ("b", F, [3]), ("c", F, [1])],
          {"x": np.arange(7, dtype=np.float32)})


def test_constant_scalar_and_list_forms():
    nodes = [helper.make_node("Constant", [], ["f"], value_float=1.5),
             helper.make_node("Constant", [], ["fs"], value_floats=[1.0, -2.0, 3.0]),
             helper.make_node("Constant", [], ["i"], value_int=2),
             helper.make_node("Constant", [], ["is"], value_ints=[3, 1, 2]),
             helper.make_node("Mul", ["x", "f"], ["xf"]),
             helper.make_node("Add", ["xf", "fs"], ["y"]),
             helper.make_node("Add", ["is", "i"], ["z"])]
    check(nodes, [("x", F, [3])], [("y", F, [3]), ("z", I64, [3])],
          {"x": np.array([1, 2, 3], np.float32)})


@pytest.mark.parametrize("dtype,k", [(TensorProto.FLOAT, 0), (TensorProto.DOUBLE, 1), (TensorProto.INT64, -2)])
def test_eye_like_makes_the_dtype_attribute_s_type(dtype, k):
    check([helper.make_node("EyeLike", ["x"], ["y"], dtype=dtype, k=k)],
          [("x", TensorProto.INT32, [3, 5])], [("y", dtype, [3, 5])],
          {"x": np.zeros((3, 5), np.int32)})


@pytest.mark.parametrize("upper", [0, 1])
def test_trilu_by_an_offset_given_at_run_time(upper):
    nodes = [helper.make_node("Trilu", ["x", "k"], ["y"], upper=upper)]
    inputs, outputs = [("x", I64, ["b", "n", "m"]), ("k", I64, [])], [("y", I64, ["b", "n", "m"])]
    session = tightfit.compile(make_model(nodes, inputs, outputs)).session()
    for shape in [(2, 4, 5), (1, 6, 3), (3, 0, 5)]:
        x = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape) + 1
        for k in (-7, -2, 0, 1, 6):
            feeds = {"x": x, "k": np.array(k, np.int64)}
            expected = run_onnxruntime(make_model(nodes, inputs, outputs), feeds)["y"]
            np.testing.assert_array_equal(session.run(feeds)["y"], expected, err_msg=f"{shape} k={k}")


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_one_hot_of_a_depth_given_at_run_time(axis):
    nodes = [helper.make_node("OneHot", ["indices", "depth", "values"], ["y"], axis=axis)]
    inputs = [("indices", I64, ["n", "m"]), ("depth", I64, [1]), ("values", F, [2])]
    model = make_model(nodes, inputs, [("y", F, [None, None, None])])
    session = tightfit.compile(model).session()
    indices = np.array([[0, 3, -1], [2, -4, 7]], np.int64)  # 7 and -4 are out of range at depth 4
    for depth in (4, 8):
        feeds = {"indices": indices, "depth": np.array([depth], np.int64),
                 "values": np.array([-1.5, 2.0], np.float32)}
        np.testing.assert_array_equal(session.run(feeds)["y"], run_onnxruntime(model, feeds)["y"],
                                      err_msg=f"depth {depth}")


@pytest.mark.parametrize("align_corners", [0, 1])
@pytest.mark.parametrize("rank", [2, 3])
def test_affine_grid_of_a_size_given_at_run_time(rank, align_corners):
    nodes = [helper.make_node("AffineGrid", ["theta", "size"], ["grid"], align_corners=align_corners)]
    inputs = [("theta", F, [2, rank, rank + 1]), ("size", I64, [rank + 2])]
    model = make_model(nodes, inputs, [("grid", F, [2] + [None] * rank + [rank])], opset=20)
    session = tightfit.compile(model).session()
    theta = np.random.default_rng(rank).standard_normal((2, rank, rank + 1)).astype(np.float32)
    for spatial in {2: ([5, 3], [1, 4]), 3: ([2, 1, 6], [3, 4, 2])}[rank]:
        feeds = {"theta": theta, "size": np.array([2, 3, *spatial], np.int64)}
        expected = ReferenceEvaluator(model).run(None, feeds)[0]
        np.testing.assert_allclose(session.run(feeds)["grid"], expected, rtol=1e-5, atol=1e-6,
                                   err_msg=f"size {spatial}")
