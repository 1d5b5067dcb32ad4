"""Reductions whose axes arrive as a tensor computed at run time (ONNX opset 13/18 `axes` input).

TVM 0.27's converters assert the axes are constant. When they are not, which dims shrink (and,
with keepdims=0, which dims remain) is known only at run time — an ISVDOS op in SoD2's terms.
The dims the keepdims=1 output has (1 where a dim is reduced, the input's dim where it is kept)
are computed as a tensor and bound to fresh symbols, and one kernel reduces the input to them:
along input dim d it loops over 1 entry where the output dim equals the input dim, and over
the input dim otherwise. A reduced dim of length 1 is the same either way, and a reduced dim of
length 0 gives a loop of none, so the result is the reduction's value over the empty set (0 for
a sum, 1 for a product, -inf for a float maximum and log-sum-exp, +inf for a float minimum, as
ONNX defines them; integers start at their lowest or highest value). The mean over an empty set
is 0 / 0. Before, the reduction ran one dim at a time, each through a reduce, a concat and a
take: 3 kernels a dim over symbolic shapes, 1.3 s of LLVM code generation for a rank-3 input.
Axes must not repeat (ONNX forbids it): with keepdims=0 the output rank is the input rank minus
their count, so that count must be static; with keepdims=1 it may be computed too (ONNX's
function bodies reduce over `Range(axis, Size(Shape(x)))`). An empty axes tensor reduces every
dim unless noop_with_empty_axes is set.

`CumSum` along an axis fed at run time (TVM: "CumSum with non-constant axis input is not
supported yet"): the input's rank is known, so the scan is computed along each axis by TVM's
kernel and the one the axis names is kept; the axis is checked when the model runs (an axis
outside the rank is an InputError). Rank-times the work of one scan; exporters give the axis
as a constant, for which TVM's single scan is used.
"""

from __future__ import annotations

import functools
import operator

import numpy as np
from tvm import relax, te, tirx
from tvm.relax.frontend.onnx import onnx_frontend
from tvm.relax.frontend.onnx.onnx_frontend import get_constant

from .ops_gather import checked_indices, take_in_range
from .ops_shape import is_runtime_tensor, named_dims, runtime_shape, runtime_symbols
from .shape_values import constant_value, known_ints, shape_values

# Each reduction as (combine two values, value over the empty set of a dtype).
_SUM = (lambda x, y: x + y, lambda dtype: tirx.const(0, dtype))
_REDUCERS = {
    "sum": _SUM,
    "mean": _SUM,
    "prod": (lambda x, y: x * y, lambda dtype: tirx.const(1, dtype)),
    "max": (lambda x, y: tirx.Or(x, y) if _is_bool(x) else tirx.Max(x, y),
            lambda dtype: _extreme(dtype, lowest=True)),
    "min": (lambda x, y: tirx.And(x, y) if _is_bool(x) else tirx.Min(x, y),
            lambda dtype: _extreme(dtype, lowest=False)),
}
_BEFORE = {"sum_square": lambda x: x * x, "l2": lambda x: x * x, "l1": tirx.abs}
_AFTER = {"l2": tirx.sqrt, "log_sum": tirx.log}


def _is_bool(value: tirx.PrimExpr) -> bool:
    """LLVM code generation has no maximum or minimum of bools: they are `or` and `and`."""
    return value.ty == "bool"


def _extreme(dtype: str, lowest: bool):
    """-inf / +inf for floats (ONNX's maximum / minimum over nothing), else the type's bound."""
    if str(dtype) == "bool":  # TVM's min_value / max_value know no bound for it
        return tirx.const(not lowest, "bool")
    if "float" in str(dtype):
        return tirx.const(float("-inf") if lowest else float("inf"), dtype)
    return tirx.min_value(dtype) if lowest else tirx.max_value(dtype)


def _reduce_to_dims(data: te.Tensor, out_dims: list, kind: str) -> te.Tensor:
    """`kind` of `data` over every dim d where out_dims[d] differs from data's dim d (then 1)."""
    in_dims = data.shape
    extents = [tirx.Select(out == dim, tirx.const(1, "int64"), dim)
               for out, dim in zip(out_dims, in_dims)]

    def reduction(reducer_name: str, element) -> te.Tensor:
        """_REDUCERS[reducer_name] of element(output index, input index) over the loops."""
        combine, identity = _REDUCERS[reducer_name]
        reducer = te.comm_reducer(combine, identity, name=reducer_name)
        loops = [te.reduce_axis((0, extent), f"k{d}") for d, extent in enumerate(extents)]
        return te.compute(out_dims, lambda *out: reducer(
            element(out, [o + k for o, k in zip(out, loops)]), axis=loops), name=f"reduce_{reducer_name}")

    before = _BEFORE.get(kind, lambda x: x)
    if kind == "log_sum_exp":
        peak = reduction("max", lambda out, at: data(*at))
        spread = reduction("sum", lambda out, at: tirx.exp(data(*at) - peak(*out)))
        return te.compute(out_dims, lambda *out: tirx.log(spread(*out)) + peak(*out), name="log_sum_exp")
    total = reduction(kind if kind in _REDUCERS else "sum", lambda out, at: before(data(*at)))
    if kind == "mean":
        count = functools.reduce(operator.mul, extents)
        if "float" not in str(data.dtype):  # an integer 0 / 0 would trap the process
            count = tirx.Max(count, tirx.const(1, "int64"))
        count = tirx.Cast(str(data.dtype), count)
        return te.compute(out_dims, lambda *out: total(*out) / count, name="mean")
    after = _AFTER.get(kind)
    return te.compute(out_dims, lambda *out: after(total(*out)), name=kind) if after else total


def _reduce_runtime_axes(bb: relax.BlockBuilder, data: relax.Expr, axes: relax.Expr, kind: str,
                         keepdims: bool, noop_with_empty_axes: bool) -> relax.Expr:
    data = named_dims(bb, data, "reduced_input_dim")
    rank = data.ty.ndim
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
    kept_dims = runtime_symbols(bb, kept_shape, "reduced_output_dim")
    result = bb.emit_te(_reduce_to_dims, data, kept_dims, kind,
                        primfunc_name_hint=f"reduce_{kind}_over_runtime_axes")
    if keepdims:
        return result
    # Kept dims first, in order: sort by (reduced, position); the first rank - len(axes) remain.
    remaining = rank - _static_length(axes)
    order = relax.op.add(relax.op.multiply(relax.op.astype(reduced, "int64"), relax.const(rank, "int64")), dims)
    kept = relax.op.strided_slice(relax.op.argsort(order, dtype="int64"), axes=[0], begin=[0], end=[remaining])
    out_shape = bb.emit(take_in_range(input_shape, kept, 0))
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
        traced = shape_values(bb, axes) if is_runtime_tensor(axes) else None
        if known_ints(traced) and all(constant_value(axis) is not None for axis in traced):
            # computed from static shapes (an inlined RMSNormalization's Range(axis, Size(Shape(x))))
            axes = relax.const(np.array([constant_value(axis) for axis in traced], "int64"))
            inputs = [inputs[0], axes, *inputs[2:]]
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


class CumSum(onnx_frontend.CumSum):
    """Along an axis known only when the model runs: every axis's scan, the named one kept."""

    @classmethod
    def _impl_v14(cls, bb, inputs, attr, params):
        axis = get_constant(inputs[1], params)
        if not is_runtime_tensor(axis):
            return super()._impl_v14(bb, inputs, attr, params)
        rank = inputs[0].ty.ndim
        one_per_axis = relax.const(np.zeros(rank, np.int8))
        axis = bb.emit(relax.op.reshape(checked_indices(bb, one_per_axis, axis, [0], "CumSum", attr), ()))
        scanned = None
        for dim in range(rank):
            scan = bb.emit(super()._impl_v14(bb, [inputs[0], relax.const(dim, "int64")], attr, params))
            named = relax.op.equal(axis, relax.const(dim, str(axis.ty.dtype)))
            scanned = scan if scanned is None else bb.emit(relax.op.where(named, scan, scanned))
        return scanned


CONVERTERS = {
    name: _runtime_axes_converter(getattr(onnx_frontend, name), kind, version)
    for name, kind, version in [
        ("ReduceSum", "sum", 13), ("ReduceMean", "mean", 18), ("ReduceMax", "max", 18),
        ("ReduceMin", "min", 18), ("ReduceProd", "prod", 18), ("ReduceSumSquare", "sum_square", 18),
        ("ReduceL1", "l1", 18), ("ReduceL2", "l2", 18), ("ReduceLogSum", "log_sum", 18),
        ("ReduceLogSumExp", "log_sum_exp", 18),
    ]
} | {"CumSum": CumSum}

