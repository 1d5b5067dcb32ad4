"""TIR schedules and kernel variants for tightfit's targets."""

from .fallback_cpu import FallbackCPUSchedule
from .pool_kernels import legalize_max_pool
from .schedule_kernels import ScheduleKernels

__all__ = ["FallbackCPUSchedule", "ScheduleKernels", "legalize_max_pool"]
