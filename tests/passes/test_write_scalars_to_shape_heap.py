"""WriteScalarsToShapeHeap: an If's condition and a NonZero count reach the VM through its shape
heap, not through a tensor allocated for one number."""

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper
from tvm import relax, tirx

import tightfit
from tightfit.feeds import run_onnxruntime
from tightfit.frontend import import_onnx
from tightfit.pipeline import run_pipeline
from tightfit.target import resolve_target
from tightfit.testing import zoo
from tightfit.vm_code import interpreted

WRITTEN = "tightfit.WriteScalarsToShapeHeap"


def _lowered(model):
    return run_pipeline(import_onnx(model).mod, resolve_target("host"), stop_after=WRITTEN)[0]


def _bindings(seq: relax.SeqExpr) -> list[relax.Binding]:
    """Every binding of `seq`, in branches too."""
    found = []
    for block in seq.blocks:
        for binding in block.bindings:
            found.append(binding)
            if isinstance(binding.value, relax.If):
                found += _bindings(binding.value.true_branch) + _bindings(binding.value.false_branch)
    return found


def _one_element_tensors(seq: relax.SeqExpr) -> list[str]:
    """The dtypes of the tensors of shape () or (1,) that `seq` allocates."""
    found = []
    for binding in _bindings(seq):
        value = binding.value
        if (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
                and value.op.name == "relax.vm.alloc_tensor" and isinstance(value.args[2], relax.ShapeExpr)
                and [int(dim) for dim in value.args[2].values] in ([], [1])):
            found.append(str(value.args[3].value))
    return found


def _builtins(seq: relax.SeqExpr) -> list[str]:
    return [binding.value.op.global_symbol for binding in _bindings(seq)
            if isinstance(binding.value, relax.Call) and isinstance(binding.value.op, relax.ExternFunc)]


def _heap_writers(mod) -> dict[str, tirx.PrimFunc]:
    return {gv.name_hint: func for gv, func in mod.functions.items()
            if gv.name_hint.startswith("write_scalar_to_heap")}


def test_an_if_on_data_branches_on_a_heap_slot_and_both_branches_match_onnxruntime():
    model = zoo.get("gated_skip_block").build()
    mod = _lowered(model)
    main = mod["main"]
    relax.analysis.well_formed(mod)
    conditions = [binding.value.cond for binding in _bindings(main.body)
                  if isinstance(binding.value, relax.If)]
    assert len(conditions) == 1 and conditions[0].ty == tvm.ir.PrimType("bool")
    assert "bool" not in _one_element_tensors(main.body)
    (writer,) = _heap_writers(mod).values()
    # the slot it writes is one past those VMShapeLower gave the symbolic dims
    heap_size = int(main.body.blocks[0].bindings[0].value.args[1].fields[0])
    assert f"shape_heap[T.int64({heap_size - 1})]" in writer.script()
    # the profiler's copy keeps its tensor, so its kernels are timed one by one
    assert "bool" in _one_element_tensors(mod[interpreted("main")].body)

    session = tightfit.compile(model).session()
    for sign, batch in [(1.0, 1), (-1.0, 1), (1.0, 3), (-1.0, 2)]:
        x = (np.random.default_rng(batch).standard_normal((batch, 8, 16, 16)) + 2 * sign).astype(np.float32)
        expected = run_onnxruntime(model, {"x": x})["y"]
        np.testing.assert_allclose(session.run({"x": x})["y"], expected, rtol=1e-5, atol=1e-5)


def test_the_package_report_counts_kernels_not_heap_writers(monkeypatch):
    """A heap writer calls a kernel and stores its number; the report's kernel count is what
    it was without the pass (gated_skip_block's condition, nonzero_gather's count)."""
    for name in ("gated_skip_block", "nonzero_gather"):
        model = zoo.get(name).build()
        with_writers = tightfit.compile(model).report["kernels"]
        with monkeypatch.context() as patched:
            patched.setattr(tightfit.pipeline, "WriteScalarsToShapeHeap",
                            lambda: tvm.transform.Sequential([], name=WRITTEN))
            without = tightfit.compile(model).report["kernels"]
        assert with_writers == without, name


def test_a_nonzero_count_is_stored_into_its_dim_slot_without_a_tensor_read_back():
    model = zoo.get("nonzero_gather").build()
    mod = _lowered(model)
    relax.analysis.well_formed(mod)
    main = mod["main"]
    assert "vm.builtin.tensor_to_shape" not in _builtins(main.body)
    assert "int64" not in _one_element_tensors(main.body)
    assert "vm.builtin.tensor_to_shape" in _builtins(mod[interpreted("main")].body)
    assert len(_heap_writers(mod)) == 1

    session = tightfit.compile(model).session()
    table = np.random.default_rng(0).standard_normal((12, 16)).astype(np.float32)
    for rows, density in [(1, 0.0), (4, 0.5), (9, 1.0), (3, 0.1)]:
        rng = np.random.default_rng(rows)
        x = np.where(rng.random((rows, 12)) < density, 1.0, -1.0).astype(np.float32)
        expected = run_onnxruntime(model, {"x": x, "table": table})["summary"]
        got = session.run({"x": x, "table": table})["summary"]
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def _if_on_a_count_model():
    """An If on whether NonZero found more than two positions: the count is read back as a dim
    (for the output's shape) and the condition is a kernel's bool, two scalars in one run."""
    count = helper.make_node("Size", ["positions"], ["count"])
    nodes = [
        helper.make_node("NonZero", ["x"], ["positions"]),
        count,
        helper.make_node("Constant", [], ["two"],
                         value=helper.make_tensor("two", TensorProto.INT64, [], [2])),
        helper.make_node("Greater", ["count", "two"], ["many"]),
        helper.make_node("If", ["many"], ["picked"],
                         then_branch=helper.make_graph(
                             [helper.make_node("Identity", ["positions"], ["then_out"])], "then", [],
                             [helper.make_tensor_value_info("then_out", TensorProto.INT64, [1, "k"])]),
                         else_branch=helper.make_graph(
                             [helper.make_node("Neg", ["positions"], ["else_out"])], "else", [],
                             [helper.make_tensor_value_info("else_out", TensorProto.INT64, [1, "k"])])),
    ]
    graph = helper.make_graph(nodes, "if_on_count",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
                              [helper.make_tensor_value_info("picked", TensorProto.INT64, [1, "k"])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("values", [[0.0, 0.0, 0.0], [1.0, 0.0, 2.0], [1.0, 3.0, 0.0, 4.0, 5.0], [7.0]])
def test_a_count_and_a_condition_in_one_run_each_get_their_slot(values):
    model = _if_on_a_count_model()
    assert len(_heap_writers(_lowered(model))) == 2
    x = np.array(values, np.float32)
    expected = run_onnxruntime(model, {"x": x})["picked"]
    got = tightfit.compile(model).session().run({"x": x})["picked"]
    assert got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)
