"""tightfit's Relax passes, one a file; the order they run in is python/tightfit/pipeline.py."""

from .pretransform_weights import PreTransformWeights

__all__ = ["PreTransformWeights"]
