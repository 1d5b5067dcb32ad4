"""TIR schedules and kernel variants for tightfit's targets."""

from .fallback_cpu import FallbackCPUSchedule
from .pool_kernels import legalize_max_pool
from .reduce_extrema import legalize_float_extrema
from .scatter_elements import legalize_scatter_elements
from .schedule_kernels import ScheduleKernels

__all__ = ["FallbackCPUSchedule", "ScheduleKernels", "legalize_as_onnx", "legalize_max_pool"]


def legalize_as_onnx() -> dict:
    """LegalizeOps' customize map for the ops whose TVM kernels compute other values than ONNX
    says (a max over a row of -inf; a scatter of indices shorter than the data): the pipeline
    legalizes with it, and FoldConstantCalls compiles the folds of those ops with it."""
    return {**legalize_float_extrema(), **legalize_scatter_elements()}
