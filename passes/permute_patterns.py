"""Relax patterns of permute_dims that a kernel can take over (its write-back or its packing
does the permutation): SelectGemmKernel's and FuseAttention's."""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax


@dataclass(frozen=True)
class Permute:
    var: relax.Var  # the permuted result
    axes: tuple[int, ...]


def permutes_of_single_use(func: relax.Function) -> dict[relax.Var, Permute]:
    """dataflow var -> the permute_dims that is its only use, where that permute keeps the last
    axis last (a matmul kernel's write-back can then store its rows in the permuted order)."""
    bindings = relax.analysis.get_var2val(func)
    permutes = {}
    for block in func.body.blocks:
        if not isinstance(block, relax.DataflowBlock):
            continue
        for var, users in relax.analysis.udchain(block).items():
            if not isinstance(var, relax.DataflowVar) or len(users) != 1:
                continue
            value = bindings.get(users[0])
            axes = permute_axes(value)
            if axes is not None and value.args[0].same_as(var) and axes[-1] == len(axes) - 1:
                permutes[var] = Permute(users[0], axes)
    return permutes


def last_two_axes_swapped(func: relax.Function) -> dict[relax.Var, relax.Expr]:
    """var bound to permute_dims(x) swapping x's last two axes -> x."""
    swapped = {}
    for var, value in relax.analysis.get_var2val(func).items():
        axes = permute_axes(value)
        if axes is not None and len(axes) >= 2 and axes == (*range(len(axes) - 2),
                                                              len(axes) - 1, len(axes) - 2):
            swapped[var] = value.args[0]
    return swapped


def permute_axes(value) -> tuple[int, ...] | None:
    """The axes of a permute_dims call (negative ones counted from the end), else None (also
    for permute_dims without axes, which reverses them)."""
    if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
            and value.op.name == "relax.permute_dims" and value.attrs.axes is not None):
        return None
    rank = len(value.attrs.axes)
    return tuple(int(axis) % rank for axis in value.attrs.axes)
