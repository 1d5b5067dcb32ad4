"""Small ONNX models where RDP's backward transfer functions and its Merge matter (SoD2 §4.1).

They are zoo entries too (`tightfit.testing.zoo`), so the zoo's tests and benchmarks run them.

- `reshape_to_computed_shape`: a Reshape whose target is computed from the input's shape by
  tensor arithmetic the importer may or may not fold (Div, Cast to float and back).
- `nonzero_rows_tied`: NonZero's count is data-dependent, but the MatMul it feeds requires it to
  equal `rows`; only backward propagation (MatMul ties its contracted dims) can learn that.
- `if_same_symbolic_shape`: both branches of an If give (2·batch, 3) — one by a computed Reshape,
  one by a constant one; Merge keeps the shape.
- `if_different_shapes`: the branches give (batch, 1) and (batch, 2); Merge must say nac for the
  second dim, never one of the two.
(ONNX Loop is not imported by TVM 0.27's frontend, so there is no Loop case.)
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17

def _model(name, nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    onnx.checker.check_model(model)
    return model


def _const(name, values, dtype=np.int64):
    return numpy_helper.from_array(np.asarray(values, dtype=dtype), name)


def _weights(name, shape, seed):
    return numpy_helper.from_array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32), name)


def reshape_to_computed_shape() -> onnx.ModelProto:
    """x[batch, seq, 16] → Reshape to [batch·seq // 2, 32] (the first dim computed as
    Gather·Gather / 2 on int64 tensors, the second as Cast(float(16)·2)) → MatMul → Reshape back to
    [batch, seq, 4] with a target taken from Shape(x)."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["b"], axis=0),
        helper.make_node("Gather", ["shape", "one"], ["s"], axis=0),
        helper.make_node("Mul", ["b", "s"], ["bs"]),
        helper.make_node("Div", ["bs", "two"], ["half"]),
        helper.make_node("Gather", ["shape", "last"], ["width"], axis=0),
        helper.make_node("Cast", ["width"], ["width_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["width_f", "two_f"], ["double_f"]),
        helper.make_node("Cast", ["double_f"], ["double"], to=TensorProto.INT64),
        helper.make_node("Concat", ["half", "double"], ["pairs_shape"], axis=0),
        helper.make_node("Reshape", ["x", "pairs_shape"], ["pairs"]),
        helper.make_node("MatMul", ["pairs", "w"], ["mixed"]),
        helper.make_node("Slice", ["shape", "zero", "two"], ["lead"]),
        helper.make_node("Concat", ["lead", "minus_one"], ["back_shape"], axis=0),
        helper.make_node("Reshape", ["mixed", "back_shape"], ["y"]),
    ]
    initializers = [_const("zero", [0]), _const("one", [1]), _const("two", [2]), _const("last", [2]),
                    _const("two_f", [2.0], np.float32), _const("minus_one", [-1]),
                    _weights("w", (32, 8), seed=11)]
    return _model("reshape_to_computed_shape", nodes,
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 16])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 4])],
                  initializers)



def nonzero_rows_tied() -> onnx.ModelProto:
    """x[rows, 4], v[rows, 8]: the rows of x whose sum is not NaN (all of them, for valid inputs)
    are gathered ([count, 4]), transposed and multiplied by v ([rows, 8]); MatMul requires
    count == rows. A second output keeps the gathered rows ([count, 4])."""
    nodes = [
        helper.make_node("ReduceSum", ["x", "axis1"], ["row_sums"], keepdims=0),
        helper.make_node("IsNaN", ["row_sums"], ["is_nan"]),
        helper.make_node("Not", ["is_nan"], ["finite"]),
        helper.make_node("NonZero", ["finite"], ["where"]),  # [1, count]
        helper.make_node("Squeeze", ["where", "axis0"], ["index"]),  # [count]
        helper.make_node("Gather", ["x", "index"], ["kept"], axis=0),  # [count, 4]
        helper.make_node("Relu", ["kept"], ["kept_relu"]),
        helper.make_node("Transpose", ["kept_relu"], ["kept_t"], perm=[1, 0]),  # [4, count]
        helper.make_node("MatMul", ["kept_t", "v"], ["mixed"]),  # [4, 8]
    ]
    return _model("nonzero_rows_tied", nodes,
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", 4]),
                   helper.make_tensor_value_info("v", TensorProto.FLOAT, ["rows", 8])],
                  [helper.make_tensor_value_info("mixed", TensorProto.FLOAT, [4, 8]),
                   helper.make_tensor_value_info("kept_relu", TensorProto.FLOAT, ["count", 4])],
                  [_const("axis1", [1]), _const("axis0", [0])])



def _if_model(name: str, then_nodes, then_out, else_nodes, else_out, then_shape, else_shape,
              out_shape, prelude=(), initializers=()) -> onnx.ModelProto:
    then_graph = helper.make_graph(list(then_nodes), "then", [],
                                   [helper.make_tensor_value_info(then_out, TensorProto.FLOAT, then_shape)])
    else_graph = helper.make_graph(list(else_nodes), "else", [],
                                   [helper.make_tensor_value_info(else_out, TensorProto.FLOAT, else_shape)])
    nodes = [
        *prelude,
        helper.make_node("ReduceMean", ["x"], ["mean"], keepdims=0),
        helper.make_node("Greater", ["mean", "zero_f"], ["positive"]),
        helper.make_node("If", ["positive"], ["branch"], then_branch=then_graph, else_branch=else_graph),
        helper.make_node("Relu", ["branch"], ["y"]),
    ]
    return _model(name, nodes,
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
                  [_const("zero_f", 0.0, np.float32), *initializers])


def if_same_symbolic_shape() -> onnx.ModelProto:
    """x[batch, 6]; then: Reshape to [batch·2, 3] with the target computed from Shape(x);
    else: Reshape to the constant [-1, 3]. Both give (2·batch, 3)."""
    prelude = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["b"], axis=0),
        helper.make_node("Mul", ["b", "two"], ["rows"]),
        helper.make_node("Concat", ["rows", "three"], ["target"], axis=0),
    ]
    then_nodes = [helper.make_node("Reshape", ["x", "target"], ["then_out"])]
    else_nodes = [helper.make_node("Reshape", ["x", "minus_one_three"], ["else_out"])]
    return _if_model("if_same_symbolic_shape", then_nodes, "then_out", else_nodes, "else_out",
                     ["r", 3], ["r", 3], ["r", 3], prelude,
                     [_const("zero", [0]), _const("two", [2]), _const("three", [3]),
                      _const("minus_one_three", [-1, 3])])


def if_different_shapes() -> onnx.ModelProto:
    """x[batch, 6]; then: ReduceSum over dim 1 kept ([batch, 1]); else: the first two columns
    ([batch, 2]). The If's second dim depends on the branch taken."""
    then_nodes = [helper.make_node("ReduceSum", ["x", "axis1"], ["then_out"], keepdims=1)]
    else_nodes = [helper.make_node("Slice", ["x", "zero", "two", "axis1"], ["else_out"])]
    return _if_model("if_different_shapes", then_nodes, "then_out", else_nodes, "else_out",
                     ["batch", 1], ["batch", 2], ["batch", "k"], (),
                     [_const("axis1", [1]), _const("zero", [0]), _const("two", [2])])


