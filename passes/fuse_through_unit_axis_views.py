"""Mark the kernels of squeeze and expand_dims elementwise, so that fusion carries a kernel's
epilogue through them.

SoD2 §4.2 (fusion of operators whose mapping is one to one). A squeeze or expand_dims of unit
axes maps each element to exactly one element with the same order; only the index list gains
or loses a zero. TVM's AnnotateTIROpPattern calls these kernels broadcast, and FuseOps joins a
kernel with an elementwise epilogue only where the op right after it is elementwise. A conv1d,
which SelectConvAlgorithm computes as the conv2d of a one-row image followed by a squeeze,
therefore kept its bias and ReLU out of the conv: speech_encoder's subsampling ran
conv2d -> [squeeze, add, relu, expand_dims] -> conv2d, two kernels where one does. Marked
elementwise, the squeeze, the epilogue and the next expand_dims become the conv's write-back
(ScheduleKernels inlines each into the store, as it does any consumer that writes as many
elements).

A view kernel that fusion leaves alone still becomes a view (KeepReshapesAsViews). Runs after
AnnotateTIROpPattern, which would overwrite the mark. Limits: reshape and flatten keep TVM's
pattern: inside a kernel their index arithmetic divides by symbolic extents.
"""

from __future__ import annotations

import tvm
from tvm import tirx

from .keep_reshapes_as_views import VIEW_KERNEL_ATTR

ELEMWISE = 0  # TVM's OpPatternKind kElemWise
UNIT_AXIS_VIEW_OPS = ("relax.squeeze", "relax.expand_dims")


@tvm.transform.module_pass(opt_level=0, name="tightfit.FuseThroughUnitAxisViews")
class FuseThroughUnitAxisViews:
    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        mod = mod.clone()
        for global_var, func in list(mod.functions.items()):
            if isinstance(func, tirx.PrimFunc) and is_unit_axis_view(func):
                mod[global_var] = func.with_attr("op_pattern", ELEMWISE)
        return mod


def is_unit_axis_view(func: tirx.PrimFunc) -> bool:
    """Whether `func` is the kernel LegalizeOps made of a squeeze or an expand_dims."""
    return func.attrs is not None and str(func.attrs.get(VIEW_KERNEL_ATTR, "")) in UNIT_AXIS_VIEW_OPS
