"""Run each loop nest's outer data-parallel loops on the thread pool.

The baseline CPU schedule every lowered PrimFunc gets: for each top-level block, the leading loops
that only feed spatial (data-parallel) block iterators are fused into one loop and marked
parallel, which works for symbolic extents too. One parallel region per loop nest: parallelizing
inner loops instead starts a region per outer iteration and was measured slower (TVM-0.27-NOTES
§5). Nests whose parallel extent is known to be small stay serial, where thread start-up would
cost more than it saves. Hand-written kernels (issue 5) replace this for the hot ops.
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx

# A fused parallel extent known to be below this runs serially.
MIN_PARALLEL_EXTENT = 16


@tvm.transform.module_pass(opt_level=0, name="tightfit.ParallelizeLoops")
class ParallelizeLoops:
    """Mark the outer spatial loops of every unscheduled PrimFunc parallel."""

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        mod = mod.clone()
        for global_var, func in list(mod.functions.items()):
            if isinstance(func, tirx.PrimFunc) and not _is_scheduled(func):
                mod[global_var] = parallelize_prim_func(func)
        return mod


def parallelize_prim_func(func: tirx.PrimFunc) -> tirx.PrimFunc:
    schedule = s_tir.Schedule(func)
    root = schedule.get_sblock("root")
    for block in schedule.get_child_blocks(root):
        loops = schedule.get_loops(block)
        count = _leading_spatial_loop_count(schedule, block, loops)
        if count == 0:
            continue
        fused = schedule.fuse(*loops[:count]) if count > 1 else loops[0]
        extent = schedule.get(fused).extent
        if isinstance(extent, tirx.IntImm) and extent.value < MIN_PARALLEL_EXTENT:
            continue
        schedule.parallel(fused)
    return schedule.mod["main"].with_attr("tirx.is_scheduled", True)


def _leading_spatial_loop_count(schedule: s_tir.Schedule, block, loops) -> int:
    """How many outer loops of `block` can run in parallel as one fused loop.

    A loop qualifies while it is serial, none of the block's reduction iterators reads its
    variable, and it wraps a single statement (fusing past a loop that holds several nests would
    interleave them). The first loop with several children may still be fused as the last one.
    """
    realize = _get_sblock_realize(schedule, block)
    reduction_vars = set()
    for iter_var, binding in zip(realize.block.iter_vars, realize.iter_values):
        if iter_var.iter_type != tirx.IterVar.DataPar:
            reduction_vars.update(tirx.analysis.undefined_vars(binding))
    count = 0
    for loop in loops:
        loop_stmt = schedule.get(loop)
        if loop_stmt.kind != tirx.ForKind.SERIAL or any(
            loop_stmt.loop_var.same_as(var) for var in reduction_vars
        ):
            break
        count += 1
        if isinstance(loop_stmt.body, tirx.SeqStmt):
            break
    return count


_get_sblock_realize = tvm.get_global_func("s_tir.schedule.GetSBlockRealize")


def _is_scheduled(func: tirx.PrimFunc) -> bool:
    return func.attrs is not None and bool(func.attrs.get("tirx.is_scheduled", False))
