"""Split by sizes given at run time or into uneven parts, and Constant's scalar and list forms,
compared with onnxruntime."""

import numpy as np
import pytest
from onnx import TensorProto, helper

import tightfit
from tightfit.feeds import run_onnxruntime


def check(nodes, inputs, outputs, feeds, opset=18):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(*spec) for spec in inputs],
                              [helper.make_tensor_value_info(*spec) for spec in outputs])
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    ours = tightfit.compile(onnx_model).session().run(feeds)
    for name, expected in run_onnxruntime(onnx_model, feeds).items():
        assert ours[name].dtype == expected.dtype, name
        np.testing.assert_array_equal(ours[name], expected, err_msg=name)


F, I64 = TensorProto.FLOAT, TensorProto.INT64


@pytest.mark.parametrize("sizes", [[1, 4, 1], [0, 2, 4]])
def test_split_by_sizes_given_at_run_time(sizes):
    check([helper.make_node("Split", ["x", "sizes"], ["a", "b", "c"], axis=1)],
          [("x", F, [2, 6]), ("sizes", I64, [3])],
          [("a", F, [2, None]), ("b", F, [2, None]), ("c", F, [2, None])],
          {"x": np.arange(12, dtype=np.float32).reshape(2, 6), "sizes": np.array(sizes, np.int64)})


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
