"""Every kernel's accumulator tile compacts to one register tile at a constant offset.

TVM keeps a small buffer as a stack array that LLVM promotes to registers only when every
access is at a constant offset (isa.py). When a tile's offset depends on the parallel loop
through a division by a symbolic extent (`fused // (height // 2)`), TVM's analyzer cannot
prove it constant, the compacted tile keeps that offset, and the accumulators live in memory:
the width-vectors conv ran 3x slower inside conv_dynamic_hw that way. The models here have
symbolic batch, height, width and sequence.
"""

import re

import pytest
import tvm
from tvm import s_tir, tirx

from tightfit.frontend import import_onnx
from tightfit.pipeline import run_pipeline
from tightfit.target import resolve_target
from tightfit.testing import zoo

LOWER_TO_FLAT_BUFFERS = tvm.transform.Sequential([
    s_tir.transform.LowerInitBlock(), s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
    s_tir.transform.ConvertBlocksToOpaque(), s_tir.transform.CompactBufferAllocation(),
    s_tir.transform.LowerMatchBuffer(), s_tir.transform.LowerOpaqueBlock(),
    tirx.transform.FlattenBuffer(),
    s_tir.transform.StmtSimplify()])
# an index that still divides, takes a remainder or clamps is not a constant offset
NOT_CONSTANT_OFFSET = re.compile(r"//|%|T\.max|T\.min")


def tile_indices(func: tirx.PrimFunc) -> dict[str, set[str]]:
    """The flattened indices of every access to a kernel's tile buffers, by buffer name."""
    text = LOWER_TO_FLAT_BUFFERS(tvm.IRModule({"main": func})).script()
    indices: dict[str, set[str]] = {}
    for name, index in re.findall(r"(\w+_tiles\w*)\[([^\]]*)\]", text):
        indices.setdefault(name, set()).add(index)
    return indices


@pytest.mark.parametrize("model", ["conv_dynamic_hw", "mobilenet_v2_style", "mobilenet_v2", "resnet_style",
                                   "transformer_encoder"])
def test_accumulator_tiles_sit_at_constant_offsets(model):
    scheduled, _ = run_pipeline(import_onnx(zoo.get(model).build()).mod, resolve_target("host"),
                                stop_after="tightfit.FallbackCPUSchedule")
    kernels = {global_var.name_hint: func for global_var, func in scheduled.functions.items()
               if isinstance(func, tirx.PrimFunc) and "tightfit.kernel" in func.script()}
    assert kernels, f"{model} has no tightfit kernels"
    for name, func in kernels.items():
        for tile, indices in tile_indices(func).items():
            moving = sorted(index for index in indices if NOT_CONSTANT_OFFSET.search(index))
            assert not moving, f"{name}: {tile} is indexed at a run-time offset: {moving[0]}"
