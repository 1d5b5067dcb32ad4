"""Element-wise math where TVM 0.27's converters disagree with ONNX on types or edge values.

- `Pow`: ONNX lets base and exponent have different element types (float base, integer
  exponent and the reverse; the output has the base's type) and allows integer bases. TVM hands
  both operands to `power`, which wants one float type ("Binary operators must have the same
  datatype", "power only applies to float"). Here an integer power is computed in float64 (exact
  for every result an int64 can hold to 2**53) and cast back.
"""

from __future__ import annotations

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


CONVERTERS = {"Pow": Pow}
