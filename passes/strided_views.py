"""Where a tensor's elements lie in a tensor it is a layout of: an offset and a stride per axis.

SoD2 §3 treats reshape, squeeze and expand_dims as relabelings of their input's elements; a
permute_dims, a slice at constant bounds, a split's part and a take at a constant index move
or drop elements but compute none either. A chain of these ops from a tensor Relax holds (a
contiguous source) to the tensor a kernel reads can be folded into the kernel's index
arithmetic: element (i_0, ..., i_n) lies at offset + sum(i_a x stride_a) of the source, so none
of the chain's copies is made. FuseAttention reads the heads that exporters split off a QKV
projection (a reshape, a transpose, then a slice, a split or a take, and a squeeze per head)
straight from the projection.

While the chain is followed each axis is a list of (extent, stride) parts, outermost first, so
that a reshape may merge axes whose elements are not evenly spaced (nn.MultiheadAttention
merges batch and heads) and a later reshape split them again. A view exists where every axis
of the last tensor is one part. Extents are proved equal, or divisible, by TVM's arithmetic
analyzer over the function's symbolic dims; every step's result is checked against the
shape Relax inferred for it.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import tvm
from tvm import relax, tirx

from .permute_patterns import permute_axes

Part = tuple  # (extent, stride): int64 expressions, in elements


@dataclass(frozen=True)
class StridedView:
    source: relax.Expr  # a tensor a kernel can be given (Relax tensors are contiguous)
    offset: tirx.PrimExpr
    shape: tuple[tirx.PrimExpr, ...]
    strides: tuple[tirx.PrimExpr, ...]

    def permuted(self, axes: list[int]) -> StridedView:
        return StridedView(self.source, self.offset, tuple(self.shape[axis] for axis in axes),
                           tuple(self.strides[axis] for axis in axes))


def strided_view(expr: relax.Expr, bindings: dict) -> StridedView | None:
    """`expr` as a view of the farthest tensor it is a layout of (module docstring); of itself
    where it is not a layout of another; None where Relax does not know its shape.
    `bindings`: relax.analysis.get_var2val of the function."""
    chain = [expr]
    while (step := _layout_input(bindings.get(chain[-1]), bindings)) is not None:
        chain.append(step)
    analyzer = tvm.sym.Analyzer()
    # the farthest source from which every step folds; a step that does not fold is a copy
    # kernel, and the view starts at its result
    for start in reversed(range(len(chain))):
        view = _fold(chain[start::-1], bindings, analyzer)
        if view is not None:
            return view
    return None


def _layout_input(value, bindings) -> relax.Expr | None:
    """The tensor a layout op `value` reads, else None."""
    if isinstance(value, relax.TupleGetItem):
        split = bindings.get(value.tuple_value)
        return split.args[0] if _is_call(split, "relax.split") else None
    if any(_is_call(value, name) for name in _LAYOUT_OPS):
        return value.args[0]
    return None


def _fold(chain: list[relax.Expr], bindings, analyzer) -> StridedView | None:
    """The view of chain[-1] in chain[0], applying each layout op in turn; None where a step
    does not fold or an axis of chain[-1] is left in several parts."""
    source = chain[0]
    shape = _static_shape(source)
    if shape is None:
        return None
    strides = [functools.reduce(operator.mul, shape[axis + 1:], tirx.const(1, "int64"))
               for axis in range(len(shape))]
    axes: list[list[Part]] | None = [[(extent, stride)] for extent, stride in zip(shape, strides)]
    offset = tirx.const(0, "int64")
    out_shape = shape
    for tensor in chain[1:]:
        out_shape = _static_shape(tensor)
        if out_shape is None:
            return None
        axes, offset = _apply(bindings[tensor], bindings, axes, offset, out_shape, analyzer)
        if axes is None or not _extents_are(axes, out_shape, analyzer):
            return None
    if any(len(parts) > 1 for parts in axes):
        return None
    return StridedView(source, analyzer.simplify(offset),
                       tuple(out_shape),
                       tuple(parts[0][1] for parts in axes))


def _apply(value, bindings, axes, offset, out_shape, analyzer):
    """(axes, offset) after the layout op `value`, whose result has `out_shape`; axes None
    where the op does not fold."""
    if isinstance(value, relax.TupleGetItem):
        split = bindings[value.tuple_value]
        axis = int(split.attrs.axis) % len(axes)
        begin = _split_begin(split, value.index, axes[axis], analyzer)
        if begin is None:
            return None, offset
        return _sliced(axes, offset, axis, begin, out_shape[axis], 1, analyzer)
    name = value.op.name
    if name in _RELABELINGS:
        return _reshaped(axes, out_shape, analyzer), offset
    if name == "relax.permute_dims":
        order = permute_axes(value) or tuple(reversed(range(len(axes))))
        return [axes[axis] for axis in order], offset
    if name == "relax.take":
        return _taken(value, axes, offset)
    # relax.strided_slice: (data, axes, begin, end[, strides]), each a tuple of dims
    sliced_axes, begins, _ = (list(value.args[index].fields) for index in (1, 2, 3))
    one = tirx.const(1, "int64")
    steps = list(value.args[4].fields) if len(value.args) > 4 else [one] * len(sliced_axes)
    for axis, begin, step in zip(sliced_axes, begins, steps):
        axis = int(axis) % len(axes)
        if not isinstance(step, tirx.IntImm) or int(step) < 1:
            return None, offset
        axes, offset = _sliced(axes, offset, axis, begin, out_shape[axis], int(step), analyzer)
        if axes is None:
            return None, offset
    return axes, offset


def _reshaped(axes: list[list[Part]], out_shape, analyzer) -> list[list[Part]] | None:
    """The parts regrouped into `out_shape`'s axes: each new axis takes whole parts while its
    extent is a multiple of theirs, and splits a part whose extent is a multiple of what it
    still needs (a part's outer piece steps by its stride times the inner piece's extent)."""
    parts = [part for axis_parts in axes for part in axis_parts if not _is_one(part[0], analyzer)]
    regrouped = []
    for extent in out_shape:
        taken, needed = [], extent
        while not _is_one(needed, analyzer):
            if not parts:
                return None
            part_extent, stride = parts[0]
            if _divides(part_extent, needed, analyzer):
                taken.append(parts.pop(0))
                needed = analyzer.simplify(tirx.floordiv(needed, part_extent))
            elif _divides(needed, part_extent, analyzer):
                rest = analyzer.simplify(tirx.floordiv(part_extent, needed))
                taken.append((needed, analyzer.simplify(stride * rest)))
                parts[0] = (rest, stride)
                needed = tirx.const(1, "int64")
            else:
                return None
        one = tirx.const(1, "int64")
        regrouped.append(_merged(taken, analyzer) or [(one, one)])
    return None if parts else regrouped


def _merged(parts: list[Part], analyzer) -> list[Part]:
    """Adjacent parts whose elements are evenly spaced across them as one part."""
    merged: list[Part] = []
    for extent, stride in parts:
        if merged and analyzer.can_prove_equal(merged[-1][1], stride * extent):
            outer_extent, _ = merged.pop()
            extent = analyzer.simplify(outer_extent * extent)
        merged.append((extent, stride))
    return merged


def _sliced(axes, offset, axis: int, begin, out_extent, step: int, analyzer):
    """(axes, offset) with axis `axis` (one part) cut to `out_extent` elements from `begin`,
    every `step`-th; None axes where the axis is in several parts or `begin` may lie outside
    it (the slice would clamp it)."""
    if len(axes[axis]) != 1:
        return None, offset
    (extent, stride), = axes[axis]
    begin = tirx.Cast("int64", begin) if begin.ty.dtype != "int64" else begin
    if not (analyzer.can_prove(begin >= 0)
            and analyzer.can_prove(begin + (out_extent - 1) * step < extent)):
        return None, offset
    new_axes = list(axes)
    new_axes[axis] = [(out_extent, analyzer.simplify(stride * step))]
    return new_axes, offset + begin * stride


def _split_begin(split, index: int, parts: list[Part], analyzer):
    """Where part `index` of a split along an axis of `parts` begins, else None."""
    sections = split.attrs.indices_or_sections
    if isinstance(sections, tirx.IntImm):
        if len(parts) != 1:
            return None
        return analyzer.simplify(tirx.floordiv(parts[0][0], int(sections)) * index)
    return tirx.const(0, "int64") if index == 0 else sections[index - 1]


def _taken(value, axes, offset):
    """take at a constant 0-d index along an axis of a constant extent (its result drops the
    axis): the index's elements' offset, else None axes."""
    index = value.args[1]
    axis = int(value.attrs.axis) % len(axes)
    if not (isinstance(index, tvm.ir.Constant) and index.value.numpy().ndim == 0
            and len(axes[axis]) == 1 and isinstance(axes[axis][0][0], tirx.IntImm)):
        return None, offset
    (extent, stride), = axes[axis]
    position = int(index.value.numpy())
    position = position + int(extent) if position < 0 else position
    if not 0 <= position < int(extent):
        return None, offset
    return axes[:axis] + axes[axis + 1:], offset + position * stride


def _extents_are(axes: list[list[Part]], shape, analyzer) -> bool:
    if len(axes) != len(shape):
        return False
    return all(analyzer.can_prove_equal(
        functools.reduce(operator.mul, [extent for extent, _ in parts], tirx.const(1, "int64")),
        dim) for parts, dim in zip(axes, shape))


def _divides(divisor, value, analyzer) -> bool:
    return analyzer.can_prove_equal(tirx.floormod(value, divisor), 0)


def _is_one(extent, analyzer) -> bool:
    return analyzer.can_prove_equal(extent, 1)


def _static_shape(expr) -> list[tirx.PrimExpr] | None:
    """The dims of a tensor whose rank and dims Relax knows, as int64 expressions."""
    ty = expr.ty
    if not (isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr)):
        return None
    return [tirx.Cast("int64", dim) if dim.ty.dtype != "int64" else dim for dim in ty.shape.values]


def _is_call(value, op_name: str) -> bool:
    return (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
            and value.op.name == op_name)


_RELABELINGS = ("relax.reshape", "relax.squeeze", "relax.expand_dims", "relax.flatten")
_LAYOUT_OPS = (*_RELABELINGS, "relax.permute_dims", "relax.strided_slice", "relax.take")
