"""tightfit's Relax passes, one a file; the order they run in is python/tightfit/pipeline.py."""

from .classify_dynamism import ClassifyDynamism
from .pretransform_weights import PreTransformWeights
from .rdp import RankDimensionPropagation

__all__ = ["ClassifyDynamism", "PreTransformWeights", "RankDimensionPropagation"]
