"""Normalizations where TVM 0.27's converters give wrong or no results.

- `LayerNormalization` has three outputs (Y, Mean, InvStdDev); TVM returns 0-d placeholders for
  the last two, so a model that uses them (training graphs, onnx's backend cases) gets wrong
  shapes. When they are asked for, all three are computed here, in the stash type.
- `RMSNormalization` over every dim (axis 0) makes TVM's `rms_norm` kernel index a 0-d buffer
  with one index ("shape.size() == indices.size()" in FoldConstant); that case is written as
  x / sqrt(mean(x²) + epsilon) * scale instead.
"""

from __future__ import annotations

import numpy as np
from onnx import helper
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend


def _stash_dtype(attr: dict) -> str:
    return str(helper.tensor_dtype_to_np_dtype(attr.get("stash_type", 1)))


def _normalized_axes(data: relax.Expr, axis: int) -> list[int]:
    rank = data.ty.ndim
    return list(range(axis % rank, rank))


class LayerNormalization(onnx_frontend.LayerNormalization):
    """Layer normalization with its Mean and InvStdDev outputs (shape of X with the normalized
    dims set to 1) when the node uses them."""

    @classmethod
    def _impl_v17(cls, bb, inputs, attr, params):
        if attr["tvm_custom"]["num_outputs"] == 1:
            return super()._impl_v17(bb, inputs, attr, params)
        data, scale = inputs[0], inputs[1]
        bias = inputs[2] if len(inputs) > 2 else None
        dtype, stash = str(data.ty.dtype), _stash_dtype(attr)
        axes = _normalized_axes(data, attr.get("axis", -1))
        epsilon = relax.const(np.array(attr.get("epsilon", 1e-5), dtype=stash), stash)
        x = bb.emit(relax.op.astype(data, stash))
        mean = bb.emit(relax.op.mean(x, axes, keepdims=True))
        centered = bb.emit(relax.op.subtract(x, mean))
        variance = relax.op.mean(relax.op.multiply(centered, centered), axes, keepdims=True)
        inverse_deviation = bb.emit(relax.op.rsqrt(relax.op.add(variance, epsilon)))
        output = relax.op.multiply(relax.op.astype(relax.op.multiply(centered, inverse_deviation), dtype),
                                   scale)
        if bias is not None:
            output = relax.op.add(output, bias)
        return relax.Tuple([bb.emit(output), mean, inverse_deviation])


class RMSNormalization(onnx_frontend.RMSNormalization):
    """RMS normalization, written out when it covers every dim of the input."""

    @classmethod
    def _impl_v23(cls, bb, inputs, attr, params):
        data, scale = inputs[0], inputs[1]
        axes = _normalized_axes(data, attr.get("axis", -1))
        if axes[0] != 0:
            return super()._impl_v23(bb, inputs, attr, params)
        dtype, stash = str(data.ty.dtype), _stash_dtype(attr)
        epsilon = relax.const(np.array(attr.get("epsilon", 1e-5), dtype=stash), stash)
        x = bb.emit(relax.op.astype(data, stash))
        mean_square = relax.op.mean(relax.op.multiply(x, x), axes, keepdims=True)
        normalized = relax.op.multiply(x, relax.op.rsqrt(relax.op.add(mean_square, epsilon)))
        return bb.emit(relax.op.multiply(relax.op.astype(normalized, dtype), scale))


CONVERTERS = {"LayerNormalization": LayerNormalization, "RMSNormalization": RMSNormalization}
