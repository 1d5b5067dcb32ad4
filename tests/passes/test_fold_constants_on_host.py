"""Calls on constants fold with numpy to exactly the values TVM's FoldConstant computes by
compiling them, and what numpy would compute differently is left to FoldConstant."""

import numpy as np
import onnxruntime
import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import tightfit
from tightfit.conformance import node_cases
from tightfit.frontend import import_onnx
from tightfit.passes import FoldConstantsOnHost
from tightfit.passes.fold_constants_on_host import MAX_FOLDED_ELEMENTS
from tightfit.pipeline import run_pipeline
from tightfit.schedules import legalize_as_onnx
from tightfit.target import resolve_target

BINARY = {
    "add": relax.op.add, "subtract": relax.op.subtract, "multiply": relax.op.multiply,
    "divide": relax.op.divide, "maximum": relax.op.maximum, "minimum": relax.op.minimum,
    "equal": relax.op.equal, "less": relax.op.less, "greater_equal": relax.op.greater_equal,
}
INTEGER_BINARY = {"floor_divide": relax.op.floor_divide, "floor_mod": relax.op.floor_mod}
UNARY = {"sqrt": relax.op.sqrt, "negative": relax.op.negative, "abs": relax.op.abs,
         "floor": relax.op.floor, "isnan": relax.op.isnan, "isinf": relax.op.isinf}


def module_of(make_call) -> tvm.IRModule:
    builder = relax.BlockBuilder()
    with builder.function("main", []):
        with builder.dataflow():
            result = builder.emit_output(make_call())
        builder.emit_func_output(result)
    return builder.get()


def returned_value(mod: tvm.IRModule):
    """The constant `main` returns (through its bindings), or None when it returns a call."""
    bindings = {binding.var: binding.value for block in mod["main"].body.blocks for binding in block.bindings}
    value = mod["main"].body.body
    while isinstance(value, relax.Var) and value in bindings:
        value = bindings[value]
    return value.value.numpy() if isinstance(value, tvm.ir.GenericConst) else None


def folded_by_both(make_call, legalizations: dict | None = None):
    """(numpy's fold, TVM FoldConstant's compiled fold) of the call `make_call` returns; with
    `legalizations`, FoldConstant compiles the kernels they give, not TVM's."""
    mod = module_of(make_call)
    ours = returned_value(FoldConstantsOnHost()(mod))
    if legalizations is not None:
        mod = relax.transform.LegalizeOps(legalizations)(mod)
    with tvm.target.Target("llvm"):
        theirs = returned_value(relax.transform.FoldConstant()(mod))
    return ours, theirs


def arrays(dtype, shape=hnp.array_shapes(max_dims=2, max_side=4)):
    if np.dtype(dtype).kind == "f":
        elements = st.floats(-100, 100, width=32) | st.sampled_from([0.0, -0.0, np.inf, -np.inf, np.nan])
    else:
        elements = st.integers(-50, 50)
    return hnp.arrays(dtype, shape, elements=elements)


@settings(max_examples=25, deadline=None)
@given(data=st.data(), name=st.sampled_from(sorted(BINARY)), dtype=st.sampled_from(["float32", "int64", "int32"]))
def test_binary_ops_fold_to_what_the_compiled_kernel_computes(data, name, dtype):
    a = data.draw(arrays(dtype))
    b = data.draw(arrays(dtype, st.just(a.shape[1:])))  # broadcast along the first dim
    if name == "divide":  # a zero divisor traps in the compiled kernel, or in TVM's simplifier
        b = np.where(b == 0, 3, b).astype(dtype)
    ours, theirs = folded_by_both(lambda: BINARY[name](relax.const(a, dtype), relax.const(b, dtype)))
    assert ours is not None, f"{name} on {dtype} was not folded"
    assert ours.dtype == theirs.dtype
    if name == "multiply" and b.ndim == 0 and b == 0:
        # TVM's simplifier rewrites x * 0.0 to 0.0 where the zero is a 0-d constant, so its fold
        # of inf * 0.0 is 0; the host fold keeps IEEE's nan, which onnxruntime computes too
        np.testing.assert_array_equal(ours, a * b)
        return
    np.testing.assert_array_equal(ours, theirs)


@settings(max_examples=15, deadline=None)
@given(data=st.data(), name=st.sampled_from(sorted(INTEGER_BINARY)))
def test_integer_floor_division_folds_as_the_kernel_rounds_negatives(data, name):
    a = data.draw(arrays("int64"))
    b = data.draw(arrays("int64", st.just(a.shape)).filter(lambda b: np.all(b != 0)))
    ours, theirs = folded_by_both(lambda: INTEGER_BINARY[name](relax.const(a, "int64"), relax.const(b, "int64")))
    np.testing.assert_array_equal(ours, theirs)


@settings(max_examples=15, deadline=None)
@given(x=arrays("float32"), name=st.sampled_from(sorted(UNARY)))
def test_unary_ops_fold_to_what_the_compiled_kernel_computes(x, name):
    ours, theirs = folded_by_both(lambda: UNARY[name](relax.const(x)))
    assert ours is not None
    np.testing.assert_array_equal(ours, theirs)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), mode=st.sampled_from(["clip", "wrap", "fast"]), dtype=st.sampled_from(["float32", "int64"]))
def test_take_folds_to_what_the_compiled_kernel_computes(data, mode, dtype):
    x = data.draw(arrays(dtype, hnp.array_shapes(min_dims=1, max_dims=3, max_side=4)))
    axis = data.draw(st.integers(-x.ndim, x.ndim - 1))
    extent = x.shape[axis]
    # "fast" reads out of bounds outside [0, extent): those indices are not compared
    low, high = (0, extent - 1) if mode == "fast" else (-2 * extent, 2 * extent)
    indices = data.draw(hnp.arrays("int64", hnp.array_shapes(min_dims=0, max_dims=2, max_side=3),
                                   elements=st.integers(low, high)))
    ours, theirs = folded_by_both(
        lambda: relax.op.take(relax.const(x, dtype), relax.const(indices, "int64"), axis=axis, mode=mode))
    assert ours is not None, f"take ({mode}) was not folded"
    np.testing.assert_array_equal(ours, theirs)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), reduction=st.sampled_from(["update", "add", "mul", "min", "max"]),
       dtype=st.sampled_from(["float32", "int32"]))
def test_scatter_elements_folds_to_what_the_compiled_kernel_computes(data, reduction, dtype):
    """Duplicate and negative indices, and indices shorter than the data, included: the updates
    apply in the kernel's order (tightfit's kernel, which LegalizeOps gives in the pipeline)."""
    x = data.draw(arrays(dtype, hnp.array_shapes(min_dims=1, max_dims=3, max_side=4)))
    axis = data.draw(st.integers(-x.ndim, x.ndim - 1))
    extent = x.shape[axis]
    shape = [data.draw(st.integers(1, 5 if dim == axis % x.ndim else side)) for dim, side in enumerate(x.shape)]
    indices = data.draw(hnp.arrays("int64", shape, elements=st.integers(-extent, extent - 1)))
    updates = data.draw(arrays(dtype, st.just(shape)))
    ours, theirs = folded_by_both(lambda: relax.op.scatter_elements(
        relax.const(x, dtype), relax.const(indices, "int64"), relax.const(updates, dtype), axis=axis,
        reduction=reduction), legalize_as_onnx())
    assert ours is not None, f"scatter_elements ({reduction}) was not folded"
    np.testing.assert_array_equal(ours, theirs)


def test_integer_ranges_fold_and_float_ranges_are_left_to_fold_constant():
    """A float range rounds `start + i * step` as the kernel's code does (perhaps in one FMA)."""
    folded = returned_value(FoldConstantsOnHost()(module_of(lambda: relax.op.arange(-3, 9, 2, "int64"))))
    np.testing.assert_array_equal(folded, np.arange(-3, 9, 2))
    assert folded.dtype == np.int64
    assert returned_value(FoldConstantsOnHost()(module_of(lambda: relax.op.arange(0, 1, 0.1, "float32")))) is None


def test_indices_out_of_range_are_left_to_fold_constant():
    """The kernel reads (take, mode "fast") or writes (scatter_elements) out of bounds there."""
    x = relax.const(np.arange(4, dtype="float32"))
    for make_call in (lambda: relax.op.take(x, relax.const(np.array([4]), "int64"), axis=0),
                      lambda: relax.op.scatter_elements(x, relax.const(np.array([-5]), "int64"),
                                                        relax.const(np.array([1.0], "float32")))):
        mod = FoldConstantsOnHost()(module_of(make_call))
        assert returned_value(mod) is None, make_call().op.name


def test_integer_division_by_zero_and_inexact_ops_are_left_to_fold_constant():
    numerator, zero = relax.const(np.array([4, 5]), "int64"), relax.const(np.array([2, 0]), "int64")
    x = relax.const(np.array([0.5, 1.5], "float32"))
    for make_call in (lambda: relax.op.divide(numerator, zero),  # would trap when compiled
                      lambda: relax.op.exp(x),  # the last bits depend on the math library
                      lambda: relax.op.sum(x),  # the kernel's summation order rounds its own way
                      lambda: relax.op.broadcast_to(x, (MAX_FOLDED_ELEMENTS, 2))):
        mod = FoldConstantsOnHost()(module_of(make_call))
        assert returned_value(mod) is None, make_call().op.name


def test_a_chain_from_a_static_shape_folds_in_one_walk():
    """ONNX's expanded Attention builds a reshape target from a tensor's shape: shape_of,
    shape_to_tensor, concat, equal, where, and an integer divide of a head count."""
    def int64s(*values):
        return relax.const(np.array(values, "int64"), "int64")

    def make_call():
        shape = relax.op.shape_to_tensor(relax.op.shape_of(relax.const(np.zeros((2, 3, 1, 6), "float32"))))
        heads = relax.op.astype(relax.op.divide(int64s(-7), int64s(2)), "int64")
        target = relax.op.concat([int64s(0, 1), heads, int64s(8)], axis=0)
        return relax.op.where(relax.op.equal(target, relax.const(1, "int64")), shape, target)
    folded = FoldConstantsOnHost()(module_of(make_call))
    np.testing.assert_array_equal(returned_value(folded), [0, 3, -3, 8])
    assert not any(isinstance(binding.value, relax.Call)
                   for block in folded["main"].body.blocks for binding in block.bindings)


def clip_model() -> tuple:
    """Conv then Clip(0, 6) with its bounds as constants, as PyTorch exports ReLU6."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["c", "low", "high"], ["y"])]
    initializers = [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w"),
                    numpy_helper.from_array(np.array(0.0, np.float32), "low"),
                    numpy_helper.from_array(np.array(6.0, np.float32), "high")]
    graph = helper.make_graph(nodes, "clip", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4, 8, 8])], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_clip_bounds_fold_on_host_and_the_model_matches_onnxruntime():
    model = clip_model()
    mod, _ = run_pipeline(import_onnx(model).mod, resolve_target("host"), stop_after="tightfit.FoldConstantsOnHost")
    script = mod.script()
    assert "isnan" not in script and "R.where" not in script
    x = np.random.default_rng(1).uniform(-3, 9, (2, 3, 8, 8)).astype(np.float32)
    (expected,) = onnxruntime.InferenceSession(model.SerializeToString()).run(None, {"x": x})
    np.testing.assert_allclose(tightfit.compile(model).session().run({"x": x})["y"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["test_attention_3d_expanded"])
def test_expanded_attention_leaves_no_shape_arithmetic_to_compile(name):
    mod, _ = run_pipeline(import_onnx(node_cases()[name].model).mod, resolve_target("host"),
                          stop_after="tightfit.FoldConstantsOnHost")
    script = mod.script()
    assert "shape_to_tensor" not in script and "R.shape_of" not in script


@pytest.mark.parametrize("name", ["test_attention_3d_causal_bf16",
                                  "test_attention_local_window_gqa_rank4_mask_expanded"])
def test_attention_masks_fold_without_compiling_a_call(name, monkeypatch):
    """A causal mask from integer ranges, and the calls FoldConstantCalls' own folds (of a take
    and a scatter) put on constants, fold with numpy: compiled one at a time they took 8 and 14
    LLVM builds of these compiles."""
    compiled = []
    fold_constant = relax.transform.FoldConstant

    def counting_fold_constant():
        compiled.append(1)
        return fold_constant()

    monkeypatch.setattr(relax.transform, "FoldConstant", counting_fold_constant)
    run_pipeline(import_onnx(node_cases()[name].model).mod, resolve_target("host"),
                 stop_after="tightfit.MoveIntoBranches")
    assert not compiled
