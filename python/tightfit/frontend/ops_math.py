"""Element-wise math where TVM 0.27's converters disagree with ONNX on types or edge values.

- `Pow`: ONNX lets base and exponent have different element types (float base, integer
  exponent and the reverse; the output has the base's type) and allows integer bases. TVM hands
  both operands to `power`, which wants one float type ("Binary operators must have the same
  datatype", "power only applies to float"). Here an integer power is computed in float64 (exact
  for every result an int64 can hold to 2**53) and cast back.
- `BitShift`: TVM shifts by the amount as it is, and LLVM's shift by a negative amount or one
  at least the type's width is undefined (the result changed with LLVM's optimizations). ONNX
  (opset 28's cases) wants such a shift to move every bit out: 0, or the sign in each bit for a
  right shift of a signed type. Here the amount is made in range and the result chosen.
- `IsInf`: TVM ignores `detect_negative` and `detect_positive` and flags both infinities.
- `Elu`: TVM's constants are float32, so a float16 or bfloat16 input fails to import ("Binary
  operators must have the same datatype"; CELU's function body is an Elu). Here they take the
  input's type.
- `Celu` (TVM has no converter): max(0, x) + min(0, alpha (exp(x / alpha) - 1)), as ONNX
  defines it, in the input's type.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend


def _is_tensor(value) -> bool:
    return isinstance(value, relax.Expr) and isinstance(value.ty, relax.TensorType)


class Pow(onnx_frontend.Pow):
    """Pow for every pair of element types ONNX allows; the result has the base's type."""

    @classmethod
    def _impl_v7(cls, bb, inputs, attr, params):
        base, exponent = inputs
        if not (_is_tensor(base) and _is_tensor(exponent)):
            return super()._impl_v7(bb, inputs, attr, params)
        base_type, exponent_type = str(base.ty.dtype), str(exponent.ty.dtype)
        if base_type.startswith(("float", "bfloat")):
            if exponent_type != base_type:
                exponent = relax.op.astype(exponent, base_type)
            return relax.op.power(base, exponent)
        power = relax.op.power(relax.op.astype(base, "float64"), relax.op.astype(exponent, "float64"))
        return relax.op.astype(power, base_type)


class BitShift(onnx_frontend.BitShift):
    """BitShift with ONNX's result for any shift amount, in range or not."""

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        value, amount = inputs
        if not (_is_tensor(value) and _is_tensor(amount)):
            return super()._impl_v11(bb, inputs, attr, params)
        dtype = str(value.ty.dtype)
        bits = tvm.DataType(dtype).bits
        signed = dtype.startswith("int")
        out_of_range = relax.op.greater_equal(amount, relax.const(bits, dtype))
        if signed:
            out_of_range = relax.op.logical_or(out_of_range, relax.op.less(amount, relax.const(0, dtype)))
        in_range = relax.op.where(out_of_range, relax.const(bits - 1, dtype), amount)
        right = attr.get("direction", b"LEFT").decode("ascii") == "RIGHT"
        shifted = (relax.op.right_shift if right else relax.op.left_shift)(value, in_range)
        if right and signed:  # a shift by bits - 1 fills every bit with the sign, as ONNX wants
            return shifted
        return relax.op.where(out_of_range, relax.const(0, dtype), shifted)



class IsInf(onnx_frontend.IsInf):
    """IsInf of the infinities its attributes ask for (both by default)."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        value = inputs[0]
        infinite = relax.op.isinf(value)
        negative, positive = attr.get("detect_negative", 1), attr.get("detect_positive", 1)
        if negative and positive:
            return infinite
        if not (negative or positive):
            return relax.op.zeros_like(infinite)
        sign = (relax.op.less if negative else relax.op.greater)(value, relax.const(0, value.ty.dtype))
        return relax.op.logical_and(infinite, sign)


class Elu(onnx_frontend.Elu):
    """alpha (exp(x) - 1) below 0, x above, in the input's float type."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        data = inputs[0]
        dtype = str(data.ty.dtype)
        alpha = relax.const(float(attr.get("alpha", 1.0)), dtype)
        below = relax.op.nn.relu(relax.op.subtract(relax.const(1.0, dtype), relax.op.exp(data)))
        return relax.op.add(relax.op.negative(relax.op.multiply(alpha, below)), relax.op.nn.relu(data))


class Celu(onnx_frontend.OnnxOpConverter):
    """max(0, x) + min(0, alpha (exp(x / alpha) - 1))."""

    @classmethod
    def _impl_v12(cls, bb, inputs, attr, params):
        data = inputs[0]
        dtype = str(data.ty.dtype)
        alpha, zero = relax.const(float(attr.get("alpha", 1.0)), dtype), relax.const(0.0, dtype)
        below = relax.op.multiply(alpha, relax.op.subtract(relax.op.exp(relax.op.divide(data, alpha)),
                                                           relax.const(1.0, dtype)))
        return relax.op.add(relax.op.maximum(zero, data), relax.op.minimum(zero, below))


CONVERTERS = {"Pow": Pow, "BitShift": BitShift, "IsInf": IsInf, "Elu": Elu, "Celu": Celu}
