"""TIR schedules and kernel variants for tightfit's targets."""

from .fallback_cpu import FallbackCPUSchedule

__all__ = ["FallbackCPUSchedule"]
