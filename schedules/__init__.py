"""TIR schedules and kernel variants for tightfit's targets."""

from .fallback_cpu import FallbackCPUSchedule
from .pool_kernels import legalize_max_pool
from .reduce_extrema import legalize_float_extrema
from .scatter_elements import legalize_scatter_elements
from .schedule_kernels import ScheduleKernels

__all__ = ["FallbackCPUSchedule", "ScheduleKernels", "legalize_float_extrema", "legalize_max_pool",
           "legalize_scatter_elements"]
