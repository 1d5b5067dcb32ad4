"""Any chain of elementwise ops after a kernel compiles and matches onnxruntime, whatever their
second operands' shapes: ScheduleKernels inlines the chain into the kernel's write-back where
it can (schedule_kernels.inline_epilogue) and leaves the rest as loops of their own. Operands
broadcast along any axes, come from the graph or from constants, stand left or right of the
op, and may broadcast the product up (more leading axes than it, which the write-back cannot
take: such a model failed to compile). Each drawn product is a tightfit kernel's (dense_packed,
matmul_packed_rhs or a conv algorithm), so its write-back is what is tested."""

from __future__ import annotations

import numpy as np
import onnx
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from tightfit.feeds import run_onnxruntime

from kernel_harness import compile_keeping, input_shapes, selected_algorithms

DEPTH = 12
UNARY_OPS = ("Relu", "Sigmoid", "Tanh", "Erf", "Abs")
BINARY_OPS = ("Add", "Sub", "Mul", "Div", "Max")
ROW_COUNTS = (1, 7, 19)  # one row, a partial register tile, a few tiles and a remainder


@st.composite
def kernels(draw):
    """(kind, product shape): a dense layer over a constant weight, a matmul of two run-time
    operands, or a conv; 'm' is the symbolic dim."""
    kind = draw(st.sampled_from(["dense", "matmul", "conv"]))
    if kind == "dense":
        return kind, [*draw(st.sampled_from([[], [2]])), "m", draw(st.sampled_from([5, 16, 37]))]
    if kind == "matmul":
        return kind, [1, 3, "m", draw(st.sampled_from([4, 17]))]
    return kind, [1, draw(st.sampled_from([3, 16])), "m", 6]


@st.composite
def operand_shapes(draw, product: list):
    """A shape that broadcasts with `product`: each axis kept or 1, leading axes dropped, or
    one leading axis of 2 added (broadcasting the product up)."""
    shape = [axis if draw(st.booleans()) else 1 for axis in product]
    leading = draw(st.sampled_from(["keep", "drop", "add"]))
    if leading == "drop":
        shape = shape[draw(st.integers(1, len(shape))):]
    elif leading == "add":
        shape = [2, *product]
    return shape


@st.composite
def epilogues(draw):
    """A kernel and one to three elementwise ops after it, each (op, operand shape or None,
    operand on the left, operand a constant)."""
    kind, product = draw(kernels())
    ops = []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            ops.append((draw(st.sampled_from(UNARY_OPS)), None, False, False))
        else:
            shape = draw(operand_shapes(product))
            op = draw(st.sampled_from(BINARY_OPS))
            # a product as divisor comes near zero, where the quotient keeps no precision
            operand_left = op != "Div" and draw(st.booleans())
            ops.append((op, shape, operand_left, "m" not in shape and draw(st.booleans())))
    return kind, product, ops


def epilogue_model(kind: str, product: list, ops: list) -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    inputs, initializers = [], []
    if kind == "dense":
        inputs.append(helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                    [*product[:-1][:-1], "m", DEPTH]))
        initializers.append(numpy_helper.from_array(
            rng.standard_normal((DEPTH, product[-1])).astype(np.float32), "w"))
        nodes = [helper.make_node("MatMul", ["x", "w"], ["v0"])]
    elif kind == "matmul":
        inputs += [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, "m", DEPTH]),
                   helper.make_tensor_value_info("w", TensorProto.FLOAT,
                                                 [1, 3, DEPTH, product[-1]])]
        nodes = [helper.make_node("MatMul", ["x", "w"], ["v0"])]
    else:
        inputs.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, "m", 6]))
        initializers.append(numpy_helper.from_array(
            rng.standard_normal((product[1], 4, 3, 3)).astype(np.float32), "w"))
        nodes = [helper.make_node("Conv", ["x", "w"], ["v0"], pads=[1, 1, 1, 1])]
    out_shape = list(product)
    for index, (op, shape, operand_left, constant) in enumerate(ops):
        source, result = f"v{index}", f"v{index + 1}"
        if shape is None:
            nodes.append(helper.make_node(op, [source], [result]))
            continue
        name = f"operand{index}"
        if constant:
            # away from zero: a divisor
            values = rng.uniform(0.5, 1.5, shape) * rng.choice([-1, 1], shape)
            initializers.append(numpy_helper.from_array(np.asarray(values, np.float32), name))
        else:
            inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))
        nodes.append(helper.make_node(op, [name, source] if operand_left else [source, name],
                                      [result]))
        out_shape = _broadcast(out_shape, shape)
    outputs = [helper.make_tensor_value_info(f"v{len(ops)}", TensorProto.FLOAT, out_shape)]
    graph = helper.make_graph(nodes, "epilogue", inputs, outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _broadcast(a: list, b: list) -> list:
    rank = max(len(a), len(b))
    a, b = [1] * (rank - len(a)) + a, [1] * (rank - len(b)) + b
    return [y if x == 1 else x for x, y in zip(a, b)]


def feeds_at(model: onnx.ModelProto, rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(rows)
    # away from zero: a divisor
    return {name: np.asarray(rng.uniform(0.5, 1.5, shape) * rng.choice([-1, 1], shape),
                             np.float32)
            for name, shape in input_shapes(model, {"m": rows}).items()}


@settings(max_examples=30, deadline=None)
@given(epilogues())
def test_any_elementwise_chain_after_a_kernel_matches_onnxruntime(epilogue):
    model = epilogue_model(*epilogue)
    package, selected = compile_keeping(model, "tightfit.SelectGemmKernel")
    assert selected_algorithms(selected), "the product is not a tightfit kernel's"
    session = package.session()
    for rows in ROW_COUNTS:
        feeds = feeds_at(model, rows)
        expected = run_onnxruntime(model, feeds)
        ours = session.run(feeds)
        for name, value in expected.items():
            np.testing.assert_allclose(ours[name], value, rtol=1e-4, atol=1e-4,
                                       err_msg=f"{epilogue} at {rows} rows")
