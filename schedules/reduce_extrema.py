"""Max and min reductions over floats that start from -inf and +inf (ONNX ReduceMax, ReduceMin).

TOPI's max starts its reduction from the lowest finite value of the type (-3.4e38 for float32),
so the max of a row that is -inf everywhere (an attention row masked out whole) came out
-3.4e38, not -inf: ONNX's expanded Attention then failed to see the row as masked
(`Equal(ReduceMax(bias), -inf)`) and returned NaN where onnx gives 0. Integer reductions keep
TOPI's kernels, whose starting values are the type's extremes, as they should be.
"""

from __future__ import annotations

import tvm
from tvm import relax, te, tirx

FLOAT_TYPES = ("float16", "float32", "float64")


def legalize_float_extrema() -> dict:
    """LegalizeOps' customize map: relax.max and relax.min over floats as these kernels."""
    return {"relax.max": _legalize("relax.max", tirx.max, -float("inf")),
            "relax.min": _legalize("relax.min", tirx.min, float("inf"))}


def _legalize(op_name: str, combine, start: float):
    default = tvm.ir.Op.get(op_name).get_attr("FLegalize")
    name = op_name.split(".")[-1]
    reducer = te.comm_reducer(lambda a, b: combine(a, b), lambda dtype: tirx.const(start, dtype),
                              name=f"{name}_from_{'minus_' if start < 0 else ''}inf")

    def legalize(builder: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        if str(call.args[0].ty.dtype) not in FLOAT_TYPES:
            return default(builder, call)
        axes = None if call.attrs.axis is None else [int(axis) for axis in call.attrs.axis]
        keepdims = bool(call.attrs.keepdims)
        return builder.call_te(lambda data: _reduce(data, axes, keepdims, reducer, f"T_{name}"),
                               call.args[0], primfunc_name_hint=name)

    return legalize


def _reduce(data: te.Tensor, axes: list[int] | None, keepdims: bool, reducer,
            name: str) -> te.Tensor:
    rank = len(data.shape)
    reduced = set(range(rank)) if axes is None else {axis % rank for axis in axes}
    loops = {axis: te.reduce_axis((0, data.shape[axis]), f"k{axis}") for axis in sorted(reduced)}
    shape = [1 if axis in reduced else dim for axis, dim in enumerate(data.shape)
             if keepdims or axis not in reduced]

    def value(*index):
        kept = iter(index)
        element = []
        for axis in range(rank):
            if axis in reduced:
                element.append(loops[axis])
                if keepdims:
                    next(kept)
            else:
                element.append(next(kept))
        return reducer(data[tuple(element)], axis=list(loops.values()))

    return te.compute(shape, value, name=name)
