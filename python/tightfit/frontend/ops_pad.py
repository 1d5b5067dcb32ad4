"""`Pad` whose pads, axes or constant value are computed in the graph or given at run time.

TVM 0.27 pads only by constants ("Dynamic pads are not supported yet"; a run-time fill value
fails on `.value`). Exported models compute
pads from shapes (pad to a multiple of a window, ONNX's own Attention function body pads a mask
to the key length), and ONNX's backend tests pass them as graph inputs. Then each output dim is
only known at run time (ISVDOS in SoD2's terms). The output dims, pads before, crops before and
kept dims are computed for every dim at once and bound to symbols, and one kernel reads output
position i of each dim from i - pad_before, mapped into [0, n) by the mode: clamped (edge, and
constant, which then fills the out-of-range positions with the value), reflected without
repeating the border (reflect), or modulo n (wrap). Negative pads crop before the rest is
padded (onnxruntime's reading; ONNX's reference cannot crop). Constant pads go to TVM's
converter. (A `take` per dim, as this was before, compiled 3 kernels a dim.)
"""

from __future__ import annotations

import functools

import tvm
from tvm import relax, te, tirx
from tvm.relax.frontend.onnx import onnx_frontend
from tvm.relax.frontend.onnx.onnx_frontend import get_constant

from ..schedules.fallback_cpu import MATERIALIZED
from .ops_gather import take_in_range
from .ops_shape import int64_tensor, named_dims, runtime_symbols

_MODES = ("constant", "edge", "reflect", "wrap")


def _int64(value) -> relax.Expr:
    return relax.const(value, "int64")


def _given(inputs, index: int, params):
    return get_constant(inputs[index], params) if len(inputs) > index and inputs[index] is not None else None


def _source_index(position: tirx.PrimExpr, dim: tirx.PrimExpr, mode: str) -> tirx.PrimExpr:
    """Where an output position (already shifted by pad_before) reads from, in [0, dim)."""
    if mode == "wrap":
        return tirx.floormod(position, dim)
    if mode == "reflect":  # period 2 (n - 1): 0 1 .. n-1 n-2 .. 1 0 1 ..; a single element repeats
        period = tirx.max(2 * (dim - 1), tirx.const(1, "int64"))
        folded = tirx.floormod(position, period)
        return tirx.Select(folded >= dim, period - folded, folded)
    return tirx.min(tirx.max(position, tirx.const(0, "int64")), dim - 1)


def _padded(data: te.Tensor, fill: te.Tensor, out_dims: list, pad_before: list, crop_before: list,
            kept_dims: list, mode: str) -> te.Tensor:
    """Each output element read from the cropped input at its mapped position, or for constant
    padding `fill` where the position is outside the kept span.

    The positions are mapped once per dim into a vector of source indices (-1 outside the span
    for constant padding), kept as buffers (MATERIALIZED): mapped for every element, the
    integer divisions of reflect and wrap made a 1x32x56x56 pad 2.5x slower than the per-dim
    takes this replaced."""

    def source_indices(axis: int) -> te.Tensor:
        def source(index):
            position = index - pad_before[axis]
            mapped = _source_index(position, kept_dims[axis], mode) + crop_before[axis]
            if mode != "constant":
                return mapped
            return tirx.Select(tirx.And(position >= 0, position < kept_dims[axis]), mapped,
                               tirx.const(-1, "int64"))

        return te.compute((out_dims[axis],), source, name=f"pad_sources{axis}",
                          attrs={MATERIALIZED: 1})

    sources = [source_indices(axis) for axis in range(len(out_dims))]

    def element(*out):
        at = [indices[index] for indices, index in zip(sources, out)]
        if mode != "constant":
            return data(*at)
        inside = functools.reduce(tirx.And, [index >= 0 for index in at])
        return tirx.if_then_else(inside, data(*at), fill())

    return te.compute(out_dims, element, name=f"pad_{mode}")


def _pad_at_runtime(bb: relax.BlockBuilder, data: relax.Expr, pads, axes, value, mode: str) -> relax.Expr:
    rank = data.ty.ndim
    if rank < 0:
        raise ValueError("Pad with run-time pads needs the input's rank")
    data = named_dims(bb, data, "padded_input_dim")
    # pads = [before of each axis..., after of each axis...]: the rank's count without axes
    pads = bb.emit(relax.op.reshape(int64_tensor(bb, pads), [2, -1 if axes is not None else rank]))
    before, after = (bb.emit(take_in_range(pads, _int64(row), 0)) for row in (0, 1))
    if axes is not None:  # pads of the other axes are 0
        axes = int64_tensor(bb, axes)
        axes = bb.emit(relax.op.where(relax.op.less(axes, _int64(0)), relax.op.add(axes, _int64(rank)), axes))
        zeros = _int64([0] * rank)
        before, after = (bb.emit(relax.op.scatter_elements(zeros, axes, pads_of_axes))
                         for pads_of_axes in (before, after))
    # Negative pads crop first (as onnxruntime does); the kept span is then padded.
    crop_before, crop_after = (bb.emit(relax.op.maximum(relax.op.negative(pad), _int64(0)))
                               for pad in (before, after))
    pad_before, pad_after = (bb.emit(relax.op.maximum(pad, _int64(0))) for pad in (before, after))
    shape = bb.emit(relax.op.shape_to_tensor(relax.op.shape_of(data)))
    kept = bb.emit(relax.op.subtract(shape, relax.op.add(crop_before, crop_after)))
    length = relax.op.add(relax.op.add(kept, pad_before), pad_after)

    dtype = str(data.ty.dtype)
    if value is None:
        fill = relax.const(0, dtype)
    else:  # a tensor, or a scalar TVM folded from shapes
        is_tensor = isinstance(value, relax.Expr) and isinstance(value.ty, relax.TensorType)
        fill = relax.op.astype(value if is_tensor else int64_tensor(bb, value), dtype)
    fill = bb.emit(relax.op.reshape(fill, []))
    symbols = [runtime_symbols(bb, bb.emit(vector), prefix) for vector, prefix in [
        (length, "pad_dim"), (pad_before, "pad_before"), (crop_before, "crop_before"), (kept, "kept_dim")]]
    return bb.emit_te(_padded, data, fill, *symbols, mode, primfunc_name_hint=f"pad_{mode}")


class Pad(onnx_frontend.Pad):
    """Pad by pads (and axes) given as tensors computed at run time; constants go to TVM."""

    @classmethod
    def _convert(cls, bb, inputs, attr, params, tvm_impl):
        pads, value, axes = (_given(inputs, i, params) for i in (1, 2, 3))
        if all(given is None or isinstance(given, tvm.ir.GenericConst) for given in (value, axes)) and isinstance(
                pads, tvm.ir.GenericConst):
            return tvm_impl(bb, inputs, attr, params)
        mode = attr.get("mode", b"constant").decode("utf-8")
        if mode not in _MODES:
            raise ValueError(f"Pad mode {mode!r} is not one of ONNX's {_MODES}")
        return _pad_at_runtime(bb, inputs[0], pads, axes, value, mode)

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        return cls._convert(bb, inputs, attr, params, super()._impl_v11)

    @classmethod
    def _impl_v18(cls, bb, inputs, attr, params):
        return cls._convert(bb, inputs, attr, params, super()._impl_v18)

    @classmethod
    def _impl_v19(cls, bb, inputs, attr, params):
        return cls._convert(bb, inputs, attr, params, super()._impl_v19)


CONVERTERS = {"Pad": Pad}
