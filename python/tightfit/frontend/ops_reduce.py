"""Reductions whose axes arrive as a tensor computed at run time (ONNX opset 13/18 `axes` input).

TVM 0.27's converters assert the axes are constant. When they are not, which dims shrink (and,
with keepdims=0, which dims remain) is known only at run time — an ISVDOS op in SoD2's terms.
The reduction is computed one dim at a time: the input reduced along dim d is put in front of
the input along d, and `take` keeps entry 0 (d among the axes) or entries 1..n (d kept). That is
exact for reductions that compose over dims (sum, mean, max, min, prod, log-sum-exp); the others
are written in terms of them (sum of squares, L1, L2, log-sum). A reduced dim of length 0 gives
the reduction's value over the empty set (0 for a sum, 1 for a product, -inf for a maximum and
log-sum-exp, +inf for a minimum, as ONNX defines them), where broadcasting the reduction back to
the input, as this file did before, lost it and the take read past the empty dim. Axes must not
repeat (ONNX forbids it): with keepdims=0 the output rank is the input rank minus their count,
so that count must be static; with keepdims=1 it may be computed too (ONNX's function bodies
reduce over `Range(axis, Size(Shape(x)))`). An empty axes tensor reduces every dim unless
noop_with_empty_axes is set.
"""

from __future__ import annotations

from tvm import relax, tirx
from tvm.relax.frontend.onnx import onnx_frontend
from tvm.relax.frontend.onnx.onnx_frontend import get_constant

from .ops_shape import is_runtime_tensor, named_dims, runtime_arange, runtime_shape

def _log_sum_exp(x: relax.Expr, axis: list[int], keepdims: bool) -> relax.Expr:
    """log(sum(exp(x))) along `axis`, stabilized by the maximum there."""
    peak = relax.op.max(x, axis=axis, keepdims=True)
    spread = relax.op.sum(relax.op.exp(relax.op.subtract(x, peak)), axis=axis, keepdims=keepdims)
    return relax.op.add(relax.op.log(spread),
                        peak if keepdims else relax.op.squeeze(peak, axis=axis))


_COMPOSING = {"sum": relax.op.sum, "mean": relax.op.mean, "max": relax.op.max,
              "min": relax.op.min, "prod": relax.op.prod, "log_sum_exp": _log_sum_exp}
# ONNX's value over an empty set of floats where TOPI's reductions start elsewhere
_EMPTY_SET = {"max": float("-inf"), "min": float("inf")}


def _reduce_runtime_axes(bb: relax.BlockBuilder, data: relax.Expr, axes: relax.Expr, kind: str,
                         keepdims: bool, noop_with_empty_axes: bool) -> relax.Expr:
    rank = len(data.ty.shape.values)
    axes = bb.emit(relax.op.astype(axes, "int64"))
    axes = bb.emit(relax.op.where(relax.op.less(axes, relax.const(0, "int64")),
                                  relax.op.add(axes, relax.const(rank, "int64")), axes))
    dims = relax.const(list(range(rank)), "int64")
    matches = relax.op.astype(relax.op.equal(relax.op.expand_dims(axes, 1), dims), "int64")
    reduced = bb.emit(relax.op.greater(relax.op.sum(matches, axis=[0]),
                                       relax.const(0, "int64")))  # [rank] bool
    if not noop_with_empty_axes:  # no axes at run time: every dim
        no_axes = relax.op.equal(relax.op.sum(matches), relax.const(0, "int64"))
        reduced = bb.emit(relax.op.logical_or(reduced, no_axes))

    input_shape = bb.emit(relax.op.shape_to_tensor(relax.op.shape_of(data)))
    kept_shape = bb.emit(relax.op.where(reduced, relax.const(1, "int64"), input_shape))

    def compose(x: relax.Expr, op) -> relax.Expr:
        """`op` over every reduced dim of `x`, one dim at a time, each reduced dim left 1 long."""
        for dim in range(rank):
            # [op along dim, x] along dim, then the first entry where dim is reduced, the rest
            # where it is kept: an empty reduced dim gives op's identity, never an entry of x
            stacked = relax.op.concat([op(x, axis=[dim], keepdims=True), x], axis=dim)
            flag = relax.op.take(reduced, relax.const(dim, "int64"), axis=0)
            first = relax.op.subtract(relax.const(1, "int64"), relax.op.astype(flag, "int64"))
            length = relax.op.strided_slice(kept_shape, axes=[0], begin=[dim], end=[dim + 1])
            entries = relax.op.add(runtime_arange(bb, length, f"reduced_dim{dim}_"), first)
            x = bb.emit(relax.op.take(stacked, entries, axis=dim))
        return x

    pre = {"sum_square": lambda x: relax.op.multiply(x, x), "l2": lambda x: relax.op.multiply(x, x),
           "l1": relax.op.abs}.get(kind, lambda x: x)
    core = _COMPOSING.get(kind, relax.op.sum)
    post = {"l2": relax.op.sqrt, "log_sum": relax.op.log}.get(kind, lambda x: x)
    result = bb.emit(post(compose(bb.emit(pre(data)), core)))
    if kind in _EMPTY_SET and "float" in str(data.ty.dtype):
        # TOPI's maximum starts at the lowest float, ONNX's at -inf (for integers, at the lowest
        # value, as TOPI's); an empty input has an empty reduced dim, or an empty result
        empty = relax.op.equal(relax.op.prod(input_shape), relax.const(0, "int64"))
        result = bb.emit(relax.op.where(empty, relax.const(_EMPTY_SET[kind], data.ty.dtype),
                                        result))
    if keepdims:
        return result
    # Kept dims first, in order: sort by (reduced, position); the first rank - len(axes) remain.
    remaining = rank - _static_length(axes)
    order = relax.op.add(relax.op.multiply(relax.op.astype(reduced, "int64"), relax.const(rank, "int64")), dims)
    kept = relax.op.strided_slice(relax.op.argsort(order, dtype="int64"), axes=[0], begin=[0], end=[remaining])
    out_shape = bb.emit(relax.op.take(input_shape, kept, axis=0))
    return named_dims(bb, bb.emit(relax.op.reshape(result, runtime_shape(bb, out_shape))), "kept_dim")


def _static_length(vector: relax.Expr) -> int:
    """The length of a 1-D tensor, which must be known when the model is compiled."""
    shape = vector.ty.shape
    if shape is None or not isinstance(shape.values[0], tirx.IntImm):
        raise ValueError("a reduction with keepdims=0 needs the number of axes to be static")
    return int(shape.values[0])


def _runtime_axes_converter(base: type, kind: str, version: int) -> type:
    """A subclass of TVM's converter `base` that handles run-time axes at `version`."""

    def convert(cls, bb, inputs, attr, params):
        axes = get_constant(inputs[1], params) if len(inputs) > 1 and inputs[1] is not None else None
        if (is_runtime_tensor(axes) and axes.ty.shape is not None
                and isinstance(axes.ty.shape.values[0], tirx.IntImm) and int(axes.ty.shape.values[0]) == 0):
            inputs = inputs[:1]  # no axes is known statically: ONNX's "all dims" or a no-op
        if not is_runtime_tensor(axes) or len(inputs) == 1:
            return getattr(super(subclass, cls), f"_impl_v{version}")(bb, inputs, attr, params)
        return _reduce_runtime_axes(bb, inputs[0], axes, kind, bool(attr.get("keepdims", 1)),
                                    bool(attr.get("noop_with_empty_axes", 0)))

    subclass = type(base.__name__, (base,), {
        "__doc__": f"{base.__name__} with axes computed at run time (see module docstring).",
        f"_impl_v{version}": classmethod(convert),
    })
    return subclass


CONVERTERS = {
    name: _runtime_axes_converter(getattr(onnx_frontend, name), kind, version)
    for name, kind, version in [
        ("ReduceSum", "sum", 13), ("ReduceMean", "mean", 18), ("ReduceMax", "max", 18),
        ("ReduceMin", "min", 18), ("ReduceProd", "prod", 18), ("ReduceSumSquare", "sum_square", 18),
        ("ReduceL1", "l1", 18), ("ReduceL2", "l2", 18), ("ReduceLogSum", "log_sum", 18),
        ("ReduceLogSumExp", "log_sum_exp", 18),
    ]
}
