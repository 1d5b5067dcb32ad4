"""tightfit's Relax passes, one a file; the order they run in is python/tightfit/pipeline.py."""

from .broadcast_at_run_time import BroadcastAtRunTime
from .check_dims_on_shapes import CheckDimsOnShapes
from .classify_dynamism import ClassifyDynamism
from .fold_batch_norm import FoldBatchNorm
from .fold_constant_calls import FoldConstantCalls
from .fold_constants_on_host import FoldConstantsOnHost
from .fuse_attention import FuseAttention
from .fuse_through_unit_axis_views import FuseThroughUnitAxisViews
from .inline_branch_functions import InlineBranchFunctions
from .keep_reshapes_as_views import KeepReshapesAsViews, legalize_views
from .launch_kernel_sequences import LaunchKernelSequences
from .lower_nonzero import LowerNonZero
from .lower_scans import LowerScans
from .move_into_branches import MoveIntoBranches
from .pretransform_weights import PreTransformWeights
from .rdp import RankDimensionPropagation
from .reuse_shape_values import ReuseShapeValues
from .select_conv_algorithm import SelectConvAlgorithm
from .select_gemm_kernel import SelectGemmKernel
from .share_identical_kernels import ShareIdenticalKernels
from .share_symbolic_storage import ShareSymbolicStorage
from .sink_into_branches import SinkIntoBranches
from .split_blocks_where_dims_are_bound import SplitBlocksWhereDimsAreBound
from .use_fast_math import UseFastMath
from .write_scalars_to_shape_heap import WriteScalarsToShapeHeap

__all__ = [
    "BroadcastAtRunTime",
    "CheckDimsOnShapes",
    "ClassifyDynamism",
    "FoldBatchNorm",
    "FoldConstantCalls",
    "FoldConstantsOnHost",
    "FuseAttention",
    "FuseThroughUnitAxisViews",
    "InlineBranchFunctions",
    "KeepReshapesAsViews",
    "LaunchKernelSequences",
    "LowerNonZero",
    "LowerScans",
    "MoveIntoBranches",
    "PreTransformWeights",
    "RankDimensionPropagation",
    "ReuseShapeValues",
    "SelectConvAlgorithm",
    "SelectGemmKernel",
    "ShareIdenticalKernels",
    "ShareSymbolicStorage",
    "SinkIntoBranches",
    "SplitBlocksWhereDimsAreBound",
    "UseFastMath",
    "WriteScalarsToShapeHeap",
    "legalize_views",
]
