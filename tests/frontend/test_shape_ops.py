"""Ops whose output shape comes from a run-time tensor, and ONNX types kept through import."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import tightfit
from tightfit.feeds import run_onnxruntime


def model(nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def check(onnx_model, feeds):
    ours = tightfit.compile(onnx_model).session().run(feeds)
    reference = run_onnxruntime(onnx_model, feeds)
    for name, expected in reference.items():
        assert ours[name].dtype == expected.dtype, name
        assert ours[name].shape == expected.shape, name
        np.testing.assert_allclose(ours[name], expected, rtol=1e-5, atol=1e-6)


def value(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def unknown(name, elem, rank):
    """An output whose dims are decided at run time (ONNX still wants its rank declared)."""
    return helper.make_tensor_value_info(name, elem, [f"{name}_{axis}" for axis in range(rank)])


@pytest.mark.parametrize("target, allowzero", [
    ([3, 4], 0), ([-1, 2], 0), ([0, -1], 0), ([2, 0, 3], 0), ([12], 0), ([4, 3], 1),
])
def test_reshape_to_a_shape_given_at_run_time(target, allowzero):
    m = model([helper.make_node("Reshape", ["x", "shape"], ["y"], allowzero=allowzero)],
              [value("x", TensorProto.FLOAT, [2, 6]), value("shape", TensorProto.INT64, [len(target)])],
              [unknown("y", TensorProto.FLOAT, len(target))])
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    if target == [2, 0, 3]:
        x = x.reshape(2, 2, 3)
        m.graph.input[0].CopyFrom(value("x", TensorProto.FLOAT, [2, 2, 3]))
    check(m, {"x": x, "shape": np.array(target, np.int64)})


def test_one_package_serves_different_run_time_shapes():
    m = model([helper.make_node("Reshape", ["x", "shape"], ["y"])],
              [value("x", TensorProto.FLOAT, ["n"]), value("shape", TensorProto.INT64, [2])],
              [unknown("y", TensorProto.FLOAT, 2)])
    session = tightfit.compile(m).session()
    for n, target in [(12, [3, -1]), (10, [-1, 5])]:
        out = session.run({"x": np.arange(n, dtype=np.float32), "shape": np.array(target, np.int64)})["y"]
        np.testing.assert_array_equal(out, np.arange(n, dtype=np.float32).reshape(target))


@pytest.mark.parametrize("largest", [1, 0])
def test_topk_with_k_given_at_run_time(largest):
    m = model([helper.make_node("TopK", ["x", "k"], ["values", "indices"], axis=1, largest=largest)],
              [value("x", TensorProto.FLOAT, [3, 10]), value("k", TensorProto.INT64, [1])],
              [unknown("values", TensorProto.FLOAT, 2), unknown("indices", TensorProto.INT64, 2)])
    x = np.random.default_rng(0).permutation(30).reshape(3, 10).astype(np.float32)
    check(m, {"x": x, "k": np.array([4], np.int64)})


def test_topk_with_k_computed_from_a_shape():
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "one"], ["n"]),
             helper.make_node("Div", ["n", "two"], ["k"]),
             helper.make_node("TopK", ["x", "k"], ["values", "indices"], axis=1)]
    m = model(nodes, [value("x", TensorProto.FLOAT, ["b", "n"])],
              [unknown("values", TensorProto.FLOAT, 2), unknown("indices", TensorProto.INT64, 2)],
              [numpy_helper.from_array(np.array([1], np.int64), "one"),
               numpy_helper.from_array(np.array([2], np.int64), "two")])
    session = tightfit.compile(m).session()
    for shape in [(2, 8), (1, 11)]:
        x = np.random.default_rng(shape[1]).standard_normal(shape).astype(np.float32)
        out = session.run({"x": x})
        assert out["values"].shape == (shape[0], shape[1] // 2)
        np.testing.assert_allclose(out["values"], run_onnxruntime(m, {"x": x})["values"])


def test_resize_to_sizes_given_at_run_time():
    m = model([helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode="nearest")],
              [value("x", TensorProto.FLOAT, [1, 2, 4, 4]), value("sizes", TensorProto.INT64, [4])],
              [unknown("y", TensorProto.FLOAT, 4)])
    x = np.arange(32, dtype=np.float32).reshape(1, 2, 4, 4)
    check(m, {"x": x, "sizes": np.array([1, 2, 8, 6], np.int64)})


def test_resize_by_scales_given_at_run_time():
    m = model([helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="nearest")],
              [value("x", TensorProto.FLOAT, [1, 1, 3, 3]), value("scales", TensorProto.FLOAT, [4])],
              [unknown("y", TensorProto.FLOAT, 4)])
    x = np.arange(9, dtype=np.float32).reshape(1, 1, 3, 3)
    check(m, {"x": x, "scales": np.array([1, 1, 2, 2], np.float32)})


def test_concat_of_shape_pieces_feeds_a_reshape_symbolically():
    # PyTorch's x.reshape(x.shape[0], -1): Shape -> Slice -> Concat with a constant -> Reshape
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Slice", ["s", "zero", "one"], ["batch"]),
             helper.make_node("Concat", ["batch", "minus_one"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["y"])]
    m = model(nodes, [value("x", TensorProto.FLOAT, ["b", 3, 4])], [value("y", TensorProto.FLOAT, ["b", 12])],
              [numpy_helper.from_array(np.array([0], np.int64), "zero"),
               numpy_helper.from_array(np.array([1], np.int64), "one"),
               numpy_helper.from_array(np.array([-1], np.int64), "minus_one")])
    check(m, {"x": np.ones((5, 3, 4), np.float32)})


def test_float64_scalar_from_shape_arithmetic_meets_float32():
    # PyTorch's attention scale: Shape -> Gather -> Cast(float) -> Pow(0.5) -> Div
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "last"], ["d"]),
             helper.make_node("Cast", ["d"], ["df"], to=TensorProto.FLOAT),
             helper.make_node("Pow", ["df", "half"], ["scale"]),
             helper.make_node("Div", ["x", "scale"], ["y"])]
    m = model(nodes, [value("x", TensorProto.FLOAT, ["b", 16])], [value("y", TensorProto.FLOAT, ["b", 16])],
              [numpy_helper.from_array(np.array(1, np.int64), "last"),
               numpy_helper.from_array(np.array(0.5, np.float32), "half")])
    check(m, {"x": np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)})


def test_outputs_keep_the_onnx_index_type():
    m = model([helper.make_node("ArgMax", ["x"], ["i"], axis=1)],
              [value("x", TensorProto.FLOAT, [2, 5])], [value("i", TensorProto.INT64, [2, 1])])
    check(m, {"x": np.random.default_rng(0).standard_normal((2, 5)).astype(np.float32)})
