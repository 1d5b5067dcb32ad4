"""ReduceMax and ReduceMin over floats (schedules/reduce_extrema.py) give onnxruntime's values,
-inf and +inf included: the max of a row that is -inf everywhere is -inf, as in a masked-out
attention row."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import tightfit
from tightfit.feeds import run_onnxruntime


def reduction_model(op: str, axes: list[int] | None, keepdims: int):
    inputs = ["x"] + (["axes"] if axes is not None else [])
    graph = helper.make_graph(
        [helper.make_node(op, inputs, ["y"], keepdims=keepdims)], "extremum",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["a", "b", "c"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None] * (3 if keepdims else 3 - len(axes)))],
        [helper.make_tensor("axes", TensorProto.INT64, [len(axes)], axes)] if axes is not None else [])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin"])
@pytest.mark.parametrize("axes,keepdims", [([-1], 1), ([0, 2], 0), (None, 1)])
def test_extrema_with_infinite_rows_match_onnxruntime(op, axes, keepdims):
    model = reduction_model(op, axes, keepdims)
    session = tightfit.compile(model).session()

    @settings(max_examples=10, deadline=None)
    @given(st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 19)), st.data())
    def check(shape, data):
        rng = np.random.default_rng(int(np.prod(shape)))
        x = rng.standard_normal(shape).astype(np.float32)
        # whole rows, and some single elements, at -inf or +inf
        rows = data.draw(st.lists(st.tuples(st.integers(0, shape[0] - 1), st.integers(0, shape[1] - 1),
                                            st.sampled_from([-np.inf, np.inf])), max_size=4))
        for first, second, infinity in rows:
            x[first, second, :] = infinity
        x[rng.random(shape) < 0.1] = data.draw(st.sampled_from([-np.inf, np.inf]))
        expected = run_onnxruntime(model, {"x": x})["y"]
        np.testing.assert_array_equal(session.run({"x": x})["y"], expected, err_msg=f"{op} of {x}")

    check()
