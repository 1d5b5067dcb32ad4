"""FoldConstantCalls folds what TVM's FoldConstant folds, to the same values, and leaves calls on
shapes not known yet as they are where FoldConstant fails on them."""

import numpy as np
import pytest
import tvm
from tvm import relax

from tightfit.passes import FoldConstantCalls


def module_of(make_body, params=()) -> tvm.IRModule:
    """`main(*params)` returning what `make_body(builder, *params)` emits."""
    builder = relax.BlockBuilder()
    with builder.function("main", list(params)):
        with builder.dataflow():
            result = builder.emit_output(make_body(builder, *params))
        builder.emit_func_output(result)
    return builder.get()


def returned(mod: tvm.IRModule) -> list:
    """What `main` returns, each field through its bindings: an array where it is a constant,
    else the expression."""
    bindings = {binding.var: binding.value for block in mod["main"].body.blocks for binding in block.bindings}

    def resolve(value):
        while isinstance(value, relax.Var) and value in bindings:
            value = bindings[value]
        return value.value.numpy() if isinstance(value, tvm.ir.GenericConst) else value

    value = resolve(mod["main"].body.body)
    return [resolve(field) for field in value.fields] if isinstance(value, relax.Tuple) else [value]


def fold_both_ways(mod: tvm.IRModule):
    with tvm.target.Target("llvm"):
        return returned(FoldConstantCalls()(mod)), returned(relax.transform.FoldConstant()(mod))


def exp_and_sum(builder):
    exp = builder.emit(relax.op.exp(relax.const(np.array([0.0, 0.5, 1.0], np.float32))))
    return relax.op.sum(exp, axis=[0])


def ones_of_a_bound_shape(builder):
    shape = builder.emit(relax.ShapeExpr([2, 3]))
    ones = builder.emit(relax.op.ones(shape, "float32"))
    return relax.op.add(ones, ones)


@pytest.mark.parametrize("make_body", [exp_and_sum, ones_of_a_bound_shape])
def test_calls_on_constants_fold_to_what_fold_constant_computes(make_body):
    ours, theirs = fold_both_ways(module_of(make_body))
    assert isinstance(ours[0], np.ndarray)
    np.testing.assert_array_equal(ours[0], theirs[0])


def test_kernels_on_constants_fold_after_legalization():
    mod = relax.transform.LegalizeOps()(module_of(exp_and_sum))
    ours, theirs = fold_both_ways(mod)
    assert isinstance(ours[0], np.ndarray)
    np.testing.assert_array_equal(ours[0], theirs[0])


@pytest.mark.parametrize("unknown_shape_call", [
    lambda a, b: relax.op.concat([a, b], axis=1),
    lambda a, b: relax.op.matmul(a, b),
], ids=["concat", "matmul"])
def test_calls_on_unknown_shapes_stay_while_the_constants_beside_them_fold(unknown_shape_call):
    """TVM 0.27's FoldConstant legalizes these calls too, and their legalizers fail without
    shapes (the compile of ONNX's expanded Attention failed so)."""
    a, b = (relax.Var(name, relax.TensorType(dtype="float32", ndim=2)) for name in "ab")

    def body(builder, a, b):
        return relax.Tuple([builder.emit(unknown_shape_call(a, b)), builder.emit(exp_and_sum(builder))])

    mod = module_of(body, (a, b))
    with tvm.target.Target("llvm"):
        call, folded = returned(FoldConstantCalls()(mod))
    assert isinstance(call, relax.Call) and isinstance(folded, np.ndarray)
    np.testing.assert_allclose(folded, np.exp(np.array([0.0, 0.5, 1.0], np.float32)).sum(), rtol=1e-6)


def test_a_fold_computes_what_tightfits_kernels_would_where_tvms_differ(monkeypatch):
    """Calls numpy does not fold (here: none, as for a tensor past the host fold's size limit)
    are compiled with the kernels the pipeline legalizes them to: a max over a row that is -inf
    everywhere is -inf (TVM's starts from the lowest finite float), and a scatter of indices
    shorter than the data lands where ONNX puts it."""
    from tightfit.passes import fold_constant_calls

    monkeypatch.setattr(fold_constant_calls, "fold_on_host", lambda call: None)
    rows = relax.const(np.array([[-np.inf, -np.inf], [1.0, -np.inf]], np.float32))
    data = relax.const(np.zeros((1, 2, 2), np.float32))
    indices = relax.const(np.zeros((1, 2, 1), np.int64))
    updates = relax.const(np.ones((1, 2, 1), np.float32))

    def body(builder):
        return relax.Tuple([builder.emit(relax.op.max(rows, axis=[1])),
                            builder.emit(relax.op.scatter_elements(data, indices, updates, axis=0))])

    with tvm.target.Target("llvm"):
        row_max, scattered = returned(FoldConstantCalls()(module_of(body)))
    np.testing.assert_array_equal(row_max, [-np.inf, 1.0])
    np.testing.assert_array_equal(scattered, [[[1.0, 0.0], [1.0, 0.0]]])
