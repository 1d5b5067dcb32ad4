"""`Pad` whose pads, axes or constant value are computed in the graph or given at run time.

TVM 0.27 pads only by constants ("Dynamic pads are not supported yet"; a run-time fill value
fails on `.value`). Exported models compute
pads from shapes (pad to a multiple of a window, ONNX's own Attention function body pads a mask
to the key length), and ONNX's backend tests pass them as graph inputs. Then each output dim is
only known at run time (ISVDOS in SoD2's terms): every padded dim becomes a `take` of source
indices i - pad_before for i in [0, n + pad_before + pad_after), mapped into [0, n) by the mode:
clamped (edge, and constant, which then masks the out-of-range positions with the value),
reflected without repeating the border (reflect), or modulo n (wrap). Negative pads crop
before the rest is padded (onnxruntime's reading; ONNX's reference cannot crop). Constant pads
go to TVM's converter.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend
from tvm.relax.frontend.onnx.onnx_frontend import get_constant

from .ops_shape import int64_tensor, runtime_arange

_MODES = ("constant", "edge", "reflect", "wrap")


def _int64(value) -> relax.Expr:
    return relax.const(value, "int64")


def _given(inputs, index: int, params):
    return get_constant(inputs[index], params) if len(inputs) > index and inputs[index] is not None else None


def _source_indices(bb: relax.BlockBuilder, positions: relax.Expr, dim: relax.Expr, mode: str) -> relax.Expr:
    """Where output positions (already shifted by pad_before) read from, in [0, dim)."""
    if mode == "wrap":
        return relax.op.floor_mod(positions, dim)
    if mode == "reflect":  # period 2 (n - 1): 0 1 .. n-1 n-2 .. 1 0 1 ..; a single element repeats
        period = bb.emit(relax.op.maximum(relax.op.multiply(relax.op.subtract(dim, _int64(1)), _int64(2)),
                                          _int64(1)))
        folded = bb.emit(relax.op.floor_mod(positions, period))
        return relax.op.where(relax.op.greater_equal(folded, dim), relax.op.subtract(period, folded), folded)
    return relax.op.minimum(relax.op.maximum(positions, _int64(0)), relax.op.subtract(dim, _int64(1)))


def _pad_at_runtime(bb: relax.BlockBuilder, data: relax.Expr, pads, axes, value, mode: str) -> relax.Expr:
    rank = data.ty.ndim
    if rank < 0:
        raise ValueError("Pad with run-time pads needs the input's rank")
    # pads = [before of each axis..., after of each axis...]: the rank's count without axes
    pads = bb.emit(relax.op.reshape(int64_tensor(bb, pads), [2, -1 if axes is not None else rank]))
    before, after = (bb.emit(relax.op.take(pads, _int64(row), axis=0)) for row in (0, 1))
    if axes is not None:  # pads of the other axes are 0
        axes = int64_tensor(bb, axes)
        axes = bb.emit(relax.op.where(relax.op.less(axes, _int64(0)), relax.op.add(axes, _int64(rank)), axes))
        zeros = _int64([0] * rank)
        before, after = (bb.emit(relax.op.scatter_elements(zeros, axes, pads_of_axes))
                         for pads_of_axes in (before, after))
    shape = bb.emit(relax.op.shape_to_tensor(relax.op.shape_of(data)))
    result, inside = data, None
    for axis in range(rank):
        def at(vector):
            return bb.emit(relax.op.take(vector, _int64(axis), axis=0))

        # Negative pads crop first (as onnxruntime does); the kept span is then padded.
        crop_before, crop_after = (bb.emit(relax.op.maximum(relax.op.negative(at(pad)), _int64(0)))
                                   for pad in (before, after))
        pad_before, pad_after = (bb.emit(relax.op.maximum(at(pad), _int64(0))) for pad in (before, after))
        dim = bb.emit(relax.op.subtract(at(shape), relax.op.add(crop_before, crop_after)))
        length = bb.emit(relax.op.add(relax.op.add(dim, pad_before), pad_after))
        positions = bb.emit(relax.op.subtract(runtime_arange(bb, length, f"pad_axis{axis}_"), pad_before))
        sources = relax.op.add(_source_indices(bb, positions, dim, mode), crop_before)
        result = bb.emit(relax.op.take(result, sources, axis=axis))
        if mode == "constant":
            valid = bb.emit(relax.op.logical_and(relax.op.greater_equal(positions, _int64(0)),
                                                 relax.op.less(positions, dim)))
            valid = relax.op.reshape(valid, [-1 if d == axis else 1 for d in range(rank)])
            inside = bb.emit(valid if inside is None else relax.op.logical_and(inside, valid))
    if mode != "constant":
        return result
    dtype = str(data.ty.dtype)
    if value is None:
        fill = relax.const(0, dtype)
    else:  # a tensor, or a scalar TVM folded from shapes
        is_tensor = isinstance(value, relax.Expr) and isinstance(value.ty, relax.TensorType)
        fill = relax.op.astype(value if is_tensor else int64_tensor(bb, value), dtype)
    return relax.op.where(inside, result, fill)


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
