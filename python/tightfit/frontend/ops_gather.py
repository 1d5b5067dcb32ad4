"""Gather, GatherElements, GatherND, ScatterElements and ScatterND with their indices checked.

TVM 0.27's converters turn negative indices positive (ScatterElements' kernel does it itself)
and hand them to `take`, `gather_elements`, `gather_nd`, `scatter_elements` or `scatter_nd`,
whose kernels read or write wherever an index points: an index past the data read another
tensor's memory or crashed the process (a token id past an embedding's vocabulary, a
segfault), where onnxruntime raises. ONNX calls such an index an error.

Here an index the model computes or takes as input goes through `checked_indices`: a stage that
makes it non-negative and, for one outside [-dim, dim), calls INDEX_ERROR_FUNCTION, which raises
InputError naming the node, the index and the dim (session.py registers it). It replaces TVM's
own negative-index stage (a `where`), so a model has no more kernels than before. Constant
indices into a dim of static size are checked when the model is imported instead.

The stage is a block of its own that the fallback schedule keeps as a buffer and runs serially
(fallback_cpu.MATERIALIZED, dispatch.SERIAL): inlined, it would be checked again for every
element read through it; in a parallel loop, TVM's thread pool dropped the error of an index in
a worker thread's share (the kernel went on with garbage) and turned one in the calling
thread's share into a RuntimeError ("Task 1 error: ..."). A package run where tightfit is not
imported (a device running TVM's own RPC server) still stops on a bad index, with "Cannot find
function tightfit.index_out_of_range", which names what happened.
"""

from __future__ import annotations

import functools

import numpy as np
import tvm
from tvm import relax, te, tirx
from tvm.relax.frontend.onnx import onnx_frontend
from tvm.relax.frontend.onnx.onnx_frontend import get_constant

from ..schedules.dispatch import SERIAL
from ..schedules.fallback_cpu import MATERIALIZED
from ..errors import ConversionError

INDEX_ERROR_FUNCTION = "tightfit.index_out_of_range"


def checked_indices(bb: relax.BlockBuilder, data: relax.Expr, indices: relax.Expr, axes: list[int],
                    op: str, attr: dict) -> relax.Expr:
    """`indices` into `data`'s `axes` made non-negative, each checked when the model runs.

    One axis: every index is into it. Several (GatherND, ScatterND): an index's position along
    the last dim of `indices` says which of `axes` it is into. The error names the node by its
    `op` type and the converter's `attr`."""
    where = f"{op} node {attr['tvm_custom']['name'] or '<unnamed>'}"
    return bb.emit_te(_checked_indices, data, indices, axes, where,
                      primfunc_name_hint="checked_indices")


def _checked_indices(data: te.Tensor, indices: te.Tensor, axes: list[int], where: str) -> te.Tensor:
    dtype = indices.dtype
    extents = [tirx.Cast(dtype, data.shape[axis]) for axis in axes]

    def extent_at(slot):
        return functools.reduce(lambda rest, j: tirx.if_then_else(slot == j, extents[j], rest),
                                range(len(extents) - 2, -1, -1), extents[-1])

    def value(*position):
        index = indices(*position)
        extent = extent_at(position[-1]) if len(extents) > 1 else extents[0]
        raised = tirx.call_packed(INDEX_ERROR_FUNCTION, tirx.Cast("int64", index),
                                  tirx.Cast("int64", extent), where)
        return tirx.if_then_else(
            tirx.all(index >= -extent, index < extent),
            tirx.if_then_else(index < 0, index + extent, index),
            tirx.Cast(dtype, raised))

    return te.compute(indices.shape, value, name="checked_indices",
                      attrs={MATERIALIZED: 1, SERIAL: 1})


def take_in_range(data: relax.Expr, indices: relax.Expr, axis: int) -> relax.Expr:
    """`take` of indices that are in range: checked, made so, or so wherever the model's
    inputs are valid (a run-time Split's sizes add up to its dim). Mode "clip", not TVM's
    default "fast": fast makes the same assumption, but TVM logs "Fast mode segfaults when there
    are out-of-bounds indices" for every such take it lowers (a transformer's user saw those
    lines at each compile), and an index out of range after all reads the nearest element
    rather than memory past the tensor. Clip costs a min and a max per index."""
    return relax.op.take(data, indices, axis, mode="clip")


def _prepared_indices(bb, data: relax.Expr, indices: relax.Expr, axes: list[int], op: str,
                      attr: dict, params) -> relax.Expr:
    """`indices` into `data`'s `axes`, non-negative: constant ones into dims of static size
    checked now (ConversionError for one out of range), any other by `checked_indices`."""
    constant = get_constant(indices, params)
    sizes = _static_sizes(data, axes)
    if not isinstance(constant, tvm.ir.GenericConst) or sizes is None:
        return checked_indices(bb, data, indices, axes, op, attr)
    values = constant.value.numpy()
    # an index tuple's slots (the last dim) are into the axes in turn
    bounds = np.array(sizes if len(axes) > 1 else sizes[0], dtype=values.dtype)
    outside = (values < -bounds) | (values >= bounds)
    if outside.any():
        at = tuple(np.argwhere(outside)[0])
        size = sizes[at[-1]] if len(axes) > 1 else sizes[0]
        raise ConversionError(attr["tvm_custom"]["name"], op,
                              f"index {values[at]} is out of range for a dim of {size} "
                              f"(valid: {-size} to {size - 1})")
    return relax.const(np.where(values < 0, values + bounds, values), values.dtype)


def _static_sizes(data: relax.Expr, axes: list[int]) -> list[int] | None:
    dims = ([len(data.values)] if isinstance(data, relax.ShapeExpr)
            else [dim for dim in data.ty.shape.values] if data.ty.shape is not None else None)
    if dims is None or not all(isinstance(dims[axis], (int, tirx.IntImm)) for axis in axes):
        return None
    return [int(dims[axis]) for axis in axes]


def _coordinate_axes(indices: relax.Expr, first_axis: int, op: str, attr: dict) -> list[int]:
    """The data axes a GatherND or ScatterND index tuple addresses, from `first_axis` on: as
    many as the tuple is long (the last dim of `indices`, which must be static)."""
    length = indices.ty.shape.values[-1] if indices.ty.shape is not None else None
    if not isinstance(length, tirx.IntImm):
        raise ConversionError(attr["tvm_custom"]["name"], op,
                              "the last dim of its indices (the length of an index tuple) must "
                              "be static")
    return [first_axis + slot for slot in range(int(length))]


class Gather(onnx_frontend.Gather):
    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        data, indices = inputs
        if isinstance(indices, relax.ShapeExpr):
            indices = bb.normalize(relax.op.shape_to_tensor(indices))
        constant = isinstance(get_constant(indices, params), tvm.ir.GenericConst)
        if isinstance(data, relax.ShapeExpr) and not constant:
            data = bb.normalize(relax.op.shape_to_tensor(data))  # the check stage takes tensors
        axis = attr.get("axis", 0) % (1 if isinstance(data, relax.ShapeExpr) else data.ty.ndim)
        indices = _prepared_indices(bb, data, indices, [axis], "Gather", attr, params)
        if isinstance(indices, tvm.ir.GenericConst) and (
                isinstance(data, tvm.ir.GenericConst)
                or isinstance(data, relax.ShapeExpr) and indices.data.numpy().ndim == 0):
            # TVM's converter computes a constant, or reads a dim of a shape value as a scalar
            return super()._impl_v13(bb, [data, indices], attr, params)
        if isinstance(data, relax.ShapeExpr):
            data = bb.normalize(relax.op.shape_to_tensor(data))
        return take_in_range(data, indices, axis)


class GatherElements(onnx_frontend.GatherElements):
    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        data, indices = inputs
        axis = attr.get("axis", 0) % data.ty.ndim
        indices = _prepared_indices(bb, data, indices, [axis], "GatherElements", attr, params)
        return relax.op.gather_elements(data, indices, axis)


class GatherND(onnx_frontend.GatherND):
    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        data, indices = inputs
        batch_dims = attr.get("batch_dims", 0)
        axes = _coordinate_axes(indices, batch_dims, "GatherND", attr)
        indices = _prepared_indices(bb, data, indices, axes, "GatherND", attr, params)
        return relax.op.gather_nd(data, indices, batch_dims)


class ScatterElements(onnx_frontend.ScatterElements):
    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        return super()._impl_v11(bb, _scatter_inputs(bb, inputs, attr, params), attr, params)

    @classmethod
    def _impl_v16(cls, bb, inputs, attr, params):
        return super()._impl_v16(bb, _scatter_inputs(bb, inputs, attr, params), attr, params)

    @classmethod
    def _impl_v18(cls, bb, inputs, attr, params):
        return super()._impl_v18(bb, _scatter_inputs(bb, inputs, attr, params), attr, params)


class ScatterND(onnx_frontend.ScatterND):
    @staticmethod
    def _normalize_indices(bb, data, indices):
        return indices  # made non-negative, and checked, by _scatter_inputs

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        checked = _scatter_inputs(bb, inputs, attr, params, nd=True)
        return super()._impl_v11(bb, checked, attr, params)

    @classmethod
    def _impl_v16(cls, bb, inputs, attr, params):
        checked = _scatter_inputs(bb, inputs, attr, params, nd=True)
        return super()._impl_v16(bb, checked, attr, params)

    @classmethod
    def _impl_v18(cls, bb, inputs, attr, params):
        checked = _scatter_inputs(bb, inputs, attr, params, nd=True)
        return super()._impl_v18(bb, checked, attr, params)


def _scatter_inputs(bb, inputs: list, attr: dict, params, nd: bool = False) -> list:
    """A scatter's (data, indices, updates) with the indices prepared (ScatterND's index tuples
    address the data's leading axes)."""
    data, indices, updates = inputs
    op = "ScatterND" if nd else "ScatterElements"
    axes = (_coordinate_axes(indices, 0, op, attr) if nd
            else [attr.get("axis", 0) % data.ty.ndim])
    return [data, _prepared_indices(bb, data, indices, axes, op, attr, params), updates]


CONVERTERS = {"Gather": Gather, "GatherElements": GatherElements, "GatherND": GatherND,
              "ScatterElements": ScatterElements, "ScatterND": ScatterND}
