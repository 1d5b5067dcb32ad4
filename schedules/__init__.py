"""TIR schedules and kernel variants for tightfit's targets."""

from .fallback_cpu import FallbackCPUSchedule
from .schedule_kernels import ScheduleKernels

__all__ = ["FallbackCPUSchedule", "ScheduleKernels"]
