"""How the kernel-selection passes put a tightfit kernel into a Relax function.

A kernel is a TE compute (schedules/gemm.py, conv2d.py) emitted as `call_tir`:
- its PrimFunc is marked `op_pattern` = OutEWiseFusable (4), so FuseOps fuses the elementwise
  ops after it (bias, BN, activation, residual add) into it. AnnotateTIROpPattern keeps a preset
  pattern; left to itself it calls a kernel whose write-back indexes by products of symbolic
  extents opaque, and nothing would fuse;
- its PrimFunc carries the selection's record (`tightfit.*` attributes: algorithm, candidates,
  memory footprint), readable in `mod.script()` until FuseTIR merges the function away; the
  kernel's tiles block keeps its kind and knobs as block annotations through fusion.
A weight-only input (a parameter after `num_input`, a constant, or a binding computed from those
alone) is what PreTransformWeights computes offline, so packing it inside the graph is free at
run time.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
import tvm_ffi
from tvm import relax, te, tirx

from .row_chunks import substitute

OUT_ELEMWISE_FUSABLE = 4


def emit_kernel(builder: relax.BlockBuilder, compute: Callable, args: list, name_hint: str,
                attrs: dict, var_name: str | None = None, plain_dims: bool = False,
                scalars: list[tuple[tirx.PrimExpr, tirx.Var]] = (), **kwargs) -> relax.Var:
    """Emit `compute(*args, **kwargs)` as call_tir to a fusable PrimFunc carrying `attrs`.

    With `plain_dims` the PrimFunc sees each dim of the tensor arguments that is an expression
    of symbols (a height of (height - 1) // 4 + 1 after a stride-2 stem and a max pool) as a
    plain variable of its own, read from the tensor's shape when it runs (`call_te` would pass
    the symbols and keep the expressions). For kernels whose unrolled body repeats those
    expressions in every index: TVM's TIR simplification over Winograd's input transform took
    25-32 s per kernel with the expressions (ResNet-18: 200 of its 238 s of compile), 3-4 s
    with plain variables. `scalars` (with `plain_dims`): (expression of the caller's symbols,
    variable `compute` uses it as) for the PrimFunc's scalar parameters, computed where the
    kernel is called."""
    if plain_dims:
        call = _call_te_over_plain_dims(builder, compute, args, name_hint, scalars, **kwargs)
    else:
        call = builder.call_te(compute, *args, primfunc_name_hint=name_hint, **kwargs)
    global_var = call.args[0]
    func = builder.get()[global_var].with_attr("op_pattern", OUT_ELEMWISE_FUSABLE)
    for key, value in attrs.items():
        func = func.with_attr(key, value)
    builder.update_func(global_var, func)
    return builder.emit(call, var_name or "lv")


def _call_te_over_plain_dims(builder: relax.BlockBuilder, compute: Callable, args: list,
                             name_hint: str, scalars: list[tuple[tirx.PrimExpr, tirx.Var]],
                             **kwargs) -> relax.Call:
    """call_tir to the PrimFunc of `compute` over placeholders whose symbolic dims are plain
    variables of the PrimFunc's own (as `call_te` makes them, one per distinct dim); the call's
    output type puts the caller's dims back, so Relax sees the shapes it computed."""
    plain: list[tuple[tirx.PrimExpr, tirx.Var]] = []

    def plain_dim(dim, name: str):
        if isinstance(dim, tirx.IntImm):
            return dim
        for expression, var in plain:
            if tvm_ffi.structural_equal(expression, dim):
                return var
        plain.append((dim, tirx.Var(dim.name if isinstance(dim, tirx.Var) else name, dim.ty.dtype)))
        return plain[-1][1]

    placeholders = [te.placeholder([plain_dim(dim, f"arg{index}_dim{axis}")
                                    for axis, dim in enumerate(arg.ty.shape.values)],
                                   arg.ty.dtype, f"arg{index}")
                    for index, arg in enumerate(args)]
    out = compute(*placeholders, **kwargs)
    # call_tir's scalar arguments follow its tensors, as the PrimFunc's parameters do
    func = te.create_prim_func([*placeholders, *[var for _, var in scalars], out], "int64")
    out_shape = [substitute(dim, {var: expression for expression, var in [*plain, *scalars]})
                 for dim in out.shape]
    return relax.call_tir(builder.add_func(func.without_attr("global_symbol"), name_hint),
                          [*args, *[expression for expression, _ in scalars]],
                          relax.TensorType(out_shape, out.dtype))


def emit_weight_transform(builder: relax.BlockBuilder, compute: Callable, args: list,
                          name_hint: str, var_name: str, **kwargs) -> relax.Var:
    """Emit a transform of weights (packing); LiftTransformParams lifts it offline.

    `var_name` becomes the transformed weight's name in the package's weight file, so it must
    be unique in the function (WeightOnly.transformed_name).
    """
    call = builder.call_te(compute, *args, primfunc_name_hint=name_hint, **kwargs)
    return builder.emit(call, var_name)


class WeightOnly:
    """Which expressions of a function are computed from its weights alone."""

    def __init__(self, func: relax.Function):
        num_input = int(func.attrs["num_input"]) if func.attrs and "num_input" in func.attrs else None
        self._weights = set(func.params[num_input:]) if num_input is not None else set()
        self._bindings = {binding.var: binding.value for block in func.body.blocks
                          for binding in block.bindings if isinstance(binding, relax.VarBinding)}
        self._memo: dict = {}
        self._names = {param.name for param in func.params}

    def transformed_name(self, expr: relax.Expr, transform: str) -> str:
        """`<source weight>.<transform>`, unique among the function's names."""
        sources = [leaf for leaf in relax.analysis.free_vars(self._bindings.get(expr, expr))
                   if leaf in self._weights] if isinstance(expr, relax.Var) else []
        if isinstance(expr, relax.Var) and expr in self._weights:
            sources = [expr]
        base = f"{sources[0].name if len(sources) == 1 else 'weight'}.{transform}"
        name, count = base, 1
        while name in self._names:
            count += 1
            name = f"{base}{count}"
        self._names.add(name)
        return name

    def __call__(self, expr: relax.Expr) -> bool:
        if isinstance(expr, tvm.ir.GenericConst):
            return True
        if not isinstance(expr, relax.Var):
            return False
        if expr in self._memo:
            return self._memo[expr]
        self._memo[expr] = False  # a cycle cannot happen in SSA; this guards the recursion
        if expr in self._weights:
            result = True
        elif expr in self._bindings:
            value = self._bindings[expr]
            leaves = relax.analysis.free_vars(value)
            result = (isinstance(value, (relax.Var, relax.Call, tvm.ir.GenericConst, relax.Tuple,
                                         relax.TupleGetItem))
                      and all(self(leaf) for leaf in leaves)
                      and not _has_impure_call(value))
        else:
            result = False
        self._memo[expr] = result
        return result


def _has_impure_call(value) -> bool:
    return isinstance(value, relax.Call) and isinstance(value.op, relax.ExternFunc)
