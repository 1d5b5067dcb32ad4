"""`Constant` in every numeric form ONNX allows.

TVM 0.27 reads only the `value` (tensor) attribute and fails on the scalar and list forms
(`value_float`, `value_floats`, `value_int`, `value_ints`), which ONNX's own function bodies use
throughout (every `_expanded` backend case of Celu, Elu, GroupNormalization, AffineGrid...) and
exporters write for small shapes and axes.
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend

# attribute -> numpy type of the constant it holds (scalars for value_float/value_int)
_NUMERIC_FORMS = {"value_float": np.float32, "value_floats": np.float32,
                  "value_int": np.int64, "value_ints": np.int64}


class Constant(onnx_frontend.Constant):
    """A constant from `value` (TVM's converter) or from a float/int scalar or list."""

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        form = next((name for name in _NUMERIC_FORMS if name in attr), None)
        if form is None:
            if "value" not in attr:
                given = sorted(set(attr) - {"tvm_custom"})
                raise ValueError(f"Constant with {given} is not supported (strings, sparse tensors)")
            return super()._impl_v13(bb, inputs, attr, params)
        value = np.asarray(attr[form], dtype=_NUMERIC_FORMS[form])
        return relax.const(value, str(value.dtype))


CONVERTERS = {"Constant": Constant}
