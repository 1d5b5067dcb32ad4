"""TIR schedules and kernel variants for tightfit's targets."""

from .parallel_loops import ParallelizeLoops

__all__ = ["ParallelizeLoops"]
