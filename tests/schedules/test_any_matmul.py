"""Every matmul matches onnxruntime, whatever its operands' shapes: batch axes that broadcast
between the two (each 1, shared, or missing on one side), a constant or run-time right operand,
given as is or as the transpose of its last two axes (the packing reads it in place), a
result transposed so its columns stay last (the write-back does it), row counts from one to
a few register tiles. SelectGemmKernel picks the dense, run-time or transposed-operand kernel;
what it does not take keeps TVM's matmul."""

from __future__ import annotations

import numpy as np
import onnx
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import tightfit
from tightfit.feeds import random_feeds, run_onnxruntime
from tightfit.frontend.importer import declared_inputs

from kernel_harness import input_shapes

ROW_COUNTS = (1, 5, 37)


@st.composite
def matmuls(draw):
    batch_rank = draw(st.integers(0, 2))
    left_batch, right_batch = [], []
    for _ in range(batch_rank):
        extent = draw(st.sampled_from([2, 3]))
        left, right = draw(st.sampled_from([(extent, extent), (extent, 1), (1, extent)]))
        left_batch.append(left)
        right_batch.append(right)
    right_rank = draw(st.integers(0, batch_rank))  # the right operand may lack leading axes
    right_batch = right_batch[batch_rank - right_rank:]
    return dict(left_batch=left_batch, right_batch=right_batch,
                depth=draw(st.integers(1, 40)), columns=draw(st.integers(1, 50)),
                constant=draw(st.booleans()) and not right_batch,
                right_transposed=draw(st.booleans()),
                result_transposed=batch_rank >= 1 and draw(st.booleans()))


def matmul_model(case: dict) -> onnx.ModelProto:
    rng = np.random.default_rng(11)
    depth, columns = case["depth"], case["columns"]
    right_shape = [*case["right_batch"],
                   *((columns, depth) if case["right_transposed"] else (depth, columns))]
    inputs = [helper.make_tensor_value_info("a", TensorProto.FLOAT,
                                            [*case["left_batch"], "m", depth])]
    initializers, nodes = [], []
    if case["constant"]:
        initializers.append(numpy_helper.from_array(
            rng.standard_normal(right_shape).astype(np.float32), "b"))
    else:
        inputs.append(helper.make_tensor_value_info("b", TensorProto.FLOAT, right_shape))
    right = "b"
    if case["right_transposed"]:
        rank = len(right_shape)
        nodes.append(helper.make_node("Transpose", ["b"], ["bt"],
                                      perm=[*range(rank - 2), rank - 1, rank - 2]))
        right = "bt"
    nodes.append(helper.make_node("MatMul", ["a", right], ["product"]))
    rank = max(len(case["left_batch"]), len(case["right_batch"])) + 2
    if case["result_transposed"]:
        # the first batch axis moved next to the rows, columns last (attention's head merge)
        perm = [*range(1, rank - 1), 0, rank - 1]
        nodes.append(helper.make_node("Transpose", ["product"], ["y"], perm=perm))
    else:
        nodes.append(helper.make_node("Identity", ["product"], ["y"]))
    graph = helper.make_graph(nodes, "any_matmul", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                             [None] * rank)],
                              initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@settings(max_examples=25, deadline=None)
@given(matmuls())
def test_any_matmul_matches_onnxruntime(case):
    model = matmul_model(case)
    session = tightfit.compile(model).session()
    for rows in ROW_COUNTS:
        feeds = random_feeds(declared_inputs(model.graph), input_shapes(model, {"m": rows}),
                             seed=rows)
        expected = run_onnxruntime(model, feeds)["y"]
        np.testing.assert_allclose(session.run(feeds)["y"], expected, rtol=1e-4, atol=1e-4,
                                   err_msg=f"{case} at {rows} rows")
