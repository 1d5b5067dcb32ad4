"""MoveIntoBranches and InlineBranchFunctions: a branch's kernels fuse with what follows its If."""

import numpy as np
import onnx
import tvm
from onnx import TensorProto, helper
from tvm import relax

import tightfit
from tightfit.feeds import run_onnxruntime
from tightfit.frontend import import_onnx
from tightfit.pipeline import run_pipeline
from tightfit.target import resolve_target
from tightfit.testing import zoo

INLINED = "tightfit.InlineBranchFunctions"


def _fused(model) -> tvm.IRModule:
    mod, _ = run_pipeline(import_onnx(model).mod, resolve_target("host"), stop_after=INLINED)
    return mod


def _top_level(func: relax.Function) -> list[relax.Binding]:
    return [binding for block in func.body.blocks for binding in block.bindings]


def _kernels(seq: relax.SeqExpr) -> list[str]:
    return [binding.value.args[0].name_hint for block in seq.blocks for binding in block.bindings
            if isinstance(binding.value, relax.Call) and binding.value.op.name == "relax.call_tir"]


def test_each_branch_of_a_gate_is_one_kernel_with_the_residual_add_after_the_if():
    """gated_skip_block: then = conv, bias, ReLU; else = x * 0.5; after the If, + x. The add
    joins each branch's kernel, and the If's result is what main returns."""
    mod = _fused(zoo.get("gated_skip_block").build())
    main = mod["main"]
    bindings = _top_level(main)
    gate = next(binding for binding in bindings if isinstance(binding.value, relax.If))
    assert main.body.body.same_as(gate.var)
    assert bindings[-1].same_as(gate)  # nothing runs after the If
    then_kernels, else_kernels = _kernels(gate.value.true_branch), _kernels(gate.value.false_branch)
    assert len(then_kernels) == 1 and "conv2d" in then_kernels[0] and "relu" in then_kernels[0]
    assert len(else_kernels) == 1 and "multiply" in else_kernels[0]
    for kernel in then_kernels + else_kernels:  # the residual add, fused into each branch
        assert kernel.rsplit("_", 1)[-1].startswith("add"), kernel
    # the outlined branch functions are gone
    assert [gv.name_hint for gv, func in mod.functions.items() if isinstance(func, relax.Function)] == ["main"]


def test_the_gate_runs_each_branch_right_and_hands_its_result_out_without_a_copy():
    spec = zoo.get("gated_skip_block")
    model = spec.build()
    package = tightfit.compile(model)
    assert package.fresh_outputs == [True]  # allocated in whichever branch runs
    session = package.session()
    for shapes in spec.shape_sets:  # even batches take the conv branch, odd ones the scale
        feeds = spec.feeds(shapes)
        first = session.run(feeds)["y"]
        np.testing.assert_allclose(first, run_onnxruntime(model, feeds)["y"], rtol=1e-4, atol=1e-5)
        kept = first.copy()
        session.run(feeds)
        np.testing.assert_array_equal(first, kept)  # the next run wrote elsewhere


def _gate_used_twice() -> onnx.ModelProto:
    """If (sum(x) > 0) then relu(x) else -x, as y; outputs y + x and the sum of y over axis 1:
    y itself is used by two nodes after the If, so neither moves into it."""
    def branch(name, node, output):
        return helper.make_graph([node], name, [],
                                 [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["n", 6])])

    nodes = [
        helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
        helper.make_node("Greater", ["total", "zero"], ["positive"]),
        helper.make_node("If", ["positive"], ["y"],
                         then_branch=branch("then", helper.make_node("Relu", ["x"], ["r"]), "r"),
                         else_branch=branch("else", helper.make_node("Neg", ["x"], ["m"]), "m")),
        helper.make_node("Add", ["y", "x"], ["shifted"]),
        helper.make_node("ReduceSum", ["y", "axis"], ["row_sums"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "gate_used_twice", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 6])],
        [helper.make_tensor_value_info("shifted", TensorProto.FLOAT, ["n", 6]),
         helper.make_tensor_value_info("row_sums", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0]),
         helper.make_tensor("axis", TensorProto.INT64, [1], [1])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_result_used_by_two_nodes_after_the_if_stays_outside_and_both_paths_are_right():
    model = _gate_used_twice()
    main = _fused(model)["main"]
    bindings = _top_level(main)
    gate_index = next(i for i, binding in enumerate(bindings) if isinstance(binding.value, relax.If))
    after = [binding for binding in bindings[gate_index + 1:]
             if isinstance(binding.value, relax.Call) and binding.value.op.name == "relax.call_tir"]
    assert len(after) >= 2  # the add and the reduction both still run after the If
    session = tightfit.compile(model).session()
    for sign in (1.0, -1.0):
        feeds = {"x": (sign * (np.arange(18, dtype=np.float32).reshape(3, 6) - 2.0))}
        expected = run_onnxruntime(model, feeds)
        for name, got in session.run(feeds).items():
            np.testing.assert_allclose(got, expected[name], rtol=1e-5, atol=1e-5, err_msg=name)


def _gate_returning_its_input() -> onnx.ModelProto:
    """If sum(x) > 0 then relu(x) else x itself: the else branch allocates nothing."""
    def branch(name, nodes, output):
        return helper.make_graph(nodes, name, [],
                                 [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["n", 6])])

    nodes = [
        helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
        helper.make_node("Greater", ["total", "zero"], ["positive"]),
        helper.make_node("If", ["positive"], ["y"],
                         then_branch=branch("then", [helper.make_node("Relu", ["x"], ["r"])], "r"),
                         else_branch=branch("else", [helper.make_node("Identity", ["x"], ["i"])], "i")),
    ]
    graph = helper.make_graph(
        nodes, "gate_returning_its_input",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 6])],
        [helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_an_if_whose_branch_may_return_the_input_hands_out_a_copy():
    """Handed out as a view, writing the output of the else branch would write the caller's x."""
    model = _gate_returning_its_input()
    package = tightfit.compile(model)
    assert package.fresh_outputs == [False]
    session = package.session()
    x = -np.arange(1, 13, dtype=np.float32).reshape(2, 6)  # negative sum: the else branch
    kept = x.copy()
    y = session.run({"x": x})["y"]
    np.testing.assert_array_equal(y, run_onnxruntime(model, {"x": kept})["y"])
    y[...] = 0
    np.testing.assert_array_equal(x, kept)
