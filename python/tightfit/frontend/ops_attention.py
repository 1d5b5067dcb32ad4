"""The standard ONNX `Attention` op (opsets 23-25), which TVM 0.27 converts as Microsoft's
contrib `Attention` (packed QKV weights, a required `num_heads`) and so cannot import.

Written after onnx's reference (`onnx/reference/ops/op_attention.py`), whose numbers the
backend tests hold: Q and K each scaled by sqrt(scale); an additive bias built from the mask
(a boolean mask means 0 / -inf, a short mask is padded with -inf), the causal and sliding-window
frontiers (offset by the past length, or per batch by `nonpad_kv_seqlen - q_len`) and the
padding of `nonpad_kv_seqlen`; softcap before the bias; a softmax whose fully masked rows (the
bias all -inf) are zero, not NaN; grouped-query attention by repeating each K/V head. 3-D inputs
are (batch, seq, heads * head_size) and go through (batch, heads, seq, head_size).
float16 and bfloat16 attention is computed in float32 and its outputs rounded once, as onnx's
reference and onnxruntime compute it: in float16 throughout, 13 of 192 outputs of
test_attention_4d_fp16 were one float16 step off.
"""

from __future__ import annotations

import math

import numpy as np
from onnx import helper
from tvm import relax, tirx
from tvm.relax.frontend.onnx import onnx_frontend

NARROW_FLOATS = ("float16", "bfloat16")

# qk_matmul_output_mode values (onnx's reference): the product after softcap (0 and 1),
# with the bias added (2), after the softmax (3).
QK_WITH_BIAS, QK_AFTER_SOFTMAX = 2, 3


def _dims(value: relax.Expr) -> list:
    """The dims of a tensor: ints where static, TIR expressions where symbolic."""
    return [int(dim) if isinstance(dim, tirx.IntImm) else dim for dim in value.ty.shape.values]


def _int64(dim) -> relax.Expr:
    """A dim (static or symbolic) as a one-element int64 tensor."""
    return relax.op.shape_to_tensor(relax.ShapeExpr([dim]))


def _scalar(value: float, dtype: str) -> relax.Expr:
    return relax.const(np.array(value, dtype=dtype), dtype)


def _heads_first(bb: relax.BlockBuilder, value: relax.Expr, heads: int) -> relax.Expr:
    """(batch, seq, heads * size) -> (batch, heads, seq, size)."""
    batch, seq, hidden = _dims(value)
    split = relax.op.reshape(value, [batch, seq, heads, hidden // heads])
    return bb.emit(relax.op.permute_dims(split, [0, 2, 1, 3]))


def _positions(length, shape: list) -> relax.Expr:
    return relax.op.reshape(relax.op.arange(0, length, 1, "int64"), shape)


class Attention(onnx_frontend.OnnxOpConverter):
    """Scaled dot-product attention with masks, KV cache and grouped-query heads."""

    @classmethod
    def _impl_v23(cls, bb, inputs, attr, params):
        def given(index):
            return inputs[index] if len(inputs) > index and inputs[index] is not None else None

        if str(inputs[0].ty.dtype) in NARROW_FLOATS:
            return cls._in_float32(bb, inputs, attr, params)
        query, key, value = inputs[0], inputs[1], inputs[2]
        mask, past_key, past_value, nonpad_kv_seqlen = given(3), given(4), given(5), given(6)
        if (past_key is None) != (past_value is None):
            raise ValueError("Attention needs past_key and past_value together")
        dtype = str(query.ty.dtype)
        rank = query.ty.ndim
        if rank == 3:
            if "q_num_heads" not in attr or "kv_num_heads" not in attr:
                raise ValueError("3-D Attention inputs need q_num_heads and kv_num_heads")
            query = _heads_first(bb, query, attr["q_num_heads"])
            key = _heads_first(bb, key, attr["kv_num_heads"])
            value = _heads_first(bb, value, attr["kv_num_heads"])
        elif rank != 4:
            raise ValueError(f"Attention inputs must be 3-D or 4-D, not {rank}-D")
        batch, q_heads, q_len, head_size = _dims(query)
        if "scale" not in attr and not isinstance(head_size, int):
            raise ValueError("Attention with a symbolic head size needs the scale attribute")
        scale = attr.get("scale", 1.0 / math.sqrt(head_size))
        scale_root = _scalar(math.sqrt(scale), dtype)

        if past_key is not None:
            key = bb.emit(relax.op.concat([past_key, key], axis=2))
            value = bb.emit(relax.op.concat([past_value, value], axis=2))
        present_key, present_value = key, value
        kv_len = _dims(key)[2]

        bias = cls._bias(bb, attr, mask, past_key, nonpad_kv_seqlen, dtype, batch, q_len, kv_len)

        kv_heads = _dims(key)[1]
        if q_heads != kv_heads:  # grouped-query attention: each K/V head serves q_heads/kv_heads
            repeats = q_heads // kv_heads
            key = bb.emit(relax.op.repeat(key, repeats, axis=1))
            value = bb.emit(relax.op.repeat(value, repeats, axis=1))

        scores = bb.emit(relax.op.matmul(
            relax.op.multiply(query, scale_root),
            relax.op.permute_dims(relax.op.multiply(key, scale_root), [0, 1, 3, 2])))
        softcap = attr.get("softcap", 0.0)
        if softcap > 0:
            cap = _scalar(softcap, dtype)
            scores = bb.emit(relax.op.multiply(relax.op.tanh(relax.op.divide(scores, cap)), cap))
        with_bias = scores if bias is None else bb.emit(relax.op.add(scores, bias))
        mode = attr.get("qk_matmul_output_mode", 0)
        qk_output = with_bias if mode == QK_WITH_BIAS else scores

        if "softmax_precision" in attr:
            softmax_dtype = str(helper.tensor_dtype_to_np_dtype(attr["softmax_precision"]))
            with_bias = bb.emit(relax.op.astype(with_bias, softmax_dtype))
        probabilities = cls._softmax(bb, with_bias)
        if bias is not None:  # a query row with every key masked attends to nothing
            peak = relax.op.max(bias, axis=-1, keepdims=True)
            fully_masked = relax.op.equal(peak, _scalar(-np.inf, dtype))
            probabilities = bb.emit(relax.op.where(
                fully_masked, _scalar(0, str(probabilities.ty.dtype)), probabilities))
        if mode == QK_AFTER_SOFTMAX:
            qk_output = probabilities
        qk_output = bb.emit(relax.op.astype(qk_output, dtype))
        probabilities = bb.emit(relax.op.astype(probabilities, dtype))

        output = bb.emit(relax.op.matmul(probabilities, value))
        if rank == 3:
            output = relax.op.permute_dims(output, [0, 2, 1, 3])
            output = bb.emit(relax.op.reshape(output, [batch, q_len, q_heads * _dims(value)[3]]))
        return relax.Tuple([output, present_key, present_value, qk_output])

    @classmethod
    def _in_float32(cls, bb, inputs, attr, params) -> relax.Tuple:
        narrow = str(inputs[0].ty.dtype)
        widened = [bb.emit(relax.op.astype(value, "float32"))
                   if value is not None and str(value.ty.dtype) == narrow else value for value in inputs]
        outputs = cls._impl_v23(bb, widened, attr, params)
        return relax.Tuple([bb.emit(relax.op.astype(output, narrow)) for output in outputs.fields])

    @staticmethod
    def _softmax(bb: relax.BlockBuilder, scores: relax.Expr) -> relax.Expr:
        """Softmax over the last axis where an all -inf row gives zeros instead of NaN."""
        dtype = str(scores.ty.dtype)
        peak = relax.op.max(scores, axis=-1, keepdims=True)
        peak = bb.emit(relax.op.where(relax.op.equal(peak, _scalar(-np.inf, dtype)),
                                      _scalar(0, dtype), peak))
        exponentials = bb.emit(relax.op.exp(relax.op.subtract(scores, peak)))
        total = relax.op.sum(exponentials, axis=-1, keepdims=True)
        total = relax.op.where(relax.op.equal(total, _scalar(0, dtype)), _scalar(1, dtype), total)
        return bb.emit(relax.op.divide(exponentials, total))

    @staticmethod
    def _bias(bb, attr, mask, past_key, nonpad_kv_seqlen, dtype, batch, q_len, kv_len):
        """The additive bias (0 where a query may attend a key, -inf elsewhere), or None."""
        zero, minus_inf = _scalar(0, dtype), _scalar(-np.inf, dtype)
        bias = None
        if mask is not None:
            mask_len = _dims(mask)[-1]
            if isinstance(mask_len, int) and isinstance(kv_len, int) and mask_len < kv_len:
                # A mask shorter than the keys leaves the keys past it masked.
                pad = [0, 0] * (mask.ty.ndim - 1) + [0, kv_len - mask_len]
                pad_value = 0 if str(mask.ty.dtype) == "bool" else -np.inf
                mask = bb.emit(relax.op.nn.pad(mask, pad, pad_value=pad_value))
            if str(mask.ty.dtype) == "bool":
                bias = bb.emit(relax.op.where(mask, zero, minus_inf))
            else:
                bias = bb.emit(relax.op.astype(mask, dtype))

        left, right = attr.get("left_window_size", -1), attr.get("right_window_size", -1)
        is_causal = bool(attr.get("is_causal", 0))
        if is_causal or left >= 0 or right >= 0:
            # Query i (at absolute position i + offset) attends key j when allowed(i + offset - j).
            if past_key is None and nonpad_kv_seqlen is not None:
                offset = relax.op.subtract(relax.op.astype(nonpad_kv_seqlen, "int64"), _int64(q_len))
                offset = relax.op.reshape(offset, [batch, 1, 1, 1])
            elif past_key is not None:
                offset = _int64(_dims(past_key)[2])
            else:
                offset = relax.const(0, "int64")
            distance = relax.op.subtract(relax.op.add(_positions(q_len, [q_len, 1]), offset),
                                         _positions(kv_len, [1, kv_len]))
            conditions = []
            if is_causal:
                conditions.append(relax.op.greater_equal(distance, relax.const(0, "int64")))
            if left >= 0:
                conditions.append(relax.op.less_equal(distance, relax.const(left, "int64")))
            if right >= 0:
                conditions.append(relax.op.less_equal(relax.op.negative(distance),
                                                      relax.const(right, "int64")))
            allowed = conditions[0]
            for condition in conditions[1:]:
                allowed = relax.op.logical_and(allowed, condition)
            frontier = bb.emit(relax.op.where(allowed, zero, minus_inf))
            bias = frontier if bias is None else bb.emit(relax.op.add(bias, frontier))

        if nonpad_kv_seqlen is not None:
            valid = relax.op.less(_positions(kv_len, [1, kv_len]),
                                  relax.op.reshape(relax.op.astype(nonpad_kv_seqlen, "int64"), [batch, 1]))
            padding = relax.op.reshape(relax.op.where(valid, zero, minus_inf), [batch, 1, 1, kv_len])
            bias = bb.emit(padding) if bias is None else bb.emit(relax.op.add(bias, padding))
        return bias


CONVERTERS = {"Attention": Attention}
