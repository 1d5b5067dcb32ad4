"""The fallback CPU schedule: inline injective blocks, then run outer loops on the thread pool.

Every lowered PrimFunc that no specialized kernel (issue 5) claims gets this schedule:
1. Inlining. FuseTIR only concatenates the blocks of a fused group; each block still writes a
   whole intermediate buffer. Padding and other injective producers are inlined into their
   consumers, elementwise epilogues into each other, until nothing more inlines. A block
   annotated MATERIALIZED (a gather's small index table, frontend/ops_pad.py) stays a buffer.
2. Parallel loops. For each remaining top-level block not annotated SERIAL (dispatch.py), up to
   MAX_FUSED_LOOPS leading loops that only feed spatial (data-parallel) block iterators are fused
   and marked parallel; this works for symbolic extents. Fusing deeper would make every element
   pay integer divisions by symbolic extents to recover its indices, and parallelizing inner
   loops instead starts a parallel region per outer iteration (TVM-0.27-NOTES §5) — both
   measured slower.
3. Serial and parallel versions. A function whose loop work may be below the parallel threshold
   (dispatch.parallel_buckets: waking the pool costs more than a small op's whole run) also
   gets a serial version, and an `if` on the work picks one at run time.
4. Reduction inits before the reduction loops. TVM lowers a reduction's init inside its
   reduction loops, guarded by "first iteration"; over an empty reduction (a sum over a zero
   dim, a count of no elements) it never runs and the output is whatever memory held.
5. Contiguous reductions in one loop. A reduction over trailing dims of its input (a global
   average pool over H and W) reads one contiguous run per output; its loops are fused into one
   so that LLVM vectorizes one long loop instead of a short one per row: a mean over
   2 x 16 x 48 x 40 went from 9.4 to 1.3 us.
6. Static inner dims in one loop. An elementwise block's innermost loops of static extent are
   fused for the same reason (LLVM vectorized a 16 x 16 map across rows, with gathers).
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx

from .dispatch import (
    DEFAULT_MIN_PARALLEL_WORK,
    SERIAL,
    join_versions,
    loop_work,
    parallel_buckets,
    with_dims_known_non_negative,
)
from .knob_database import KnobDatabase

# A block annotated so stays a buffer: a small table (a gather's per-dim source indices) whose
# values, inlined, would be recomputed for every element that reads them.
MATERIALIZED = "tightfit.materialized"
# A fused loop with fewer iterations than this cannot keep two threads busy.
MIN_PARALLEL_EXTENT = 2
MAX_FUSED_LOOPS = 2


@tvm.transform.module_pass(opt_level=0, name="tightfit.FallbackCPUSchedule")
class FallbackCPUSchedule:
    """Inline injective blocks and parallelize outer loops of every unscheduled PrimFunc."""

    def __init__(self, knob_database: str | None = None):
        self.knob_database = knob_database

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        target = tvm.target.Target.current(allow_none=True)
        min_parallel_work = KnobDatabase.open(self.knob_database, target).min_parallel_work()
        mod = mod.clone()
        for global_var, func in list(mod.functions.items()):
            if isinstance(func, tirx.PrimFunc) and not is_scheduled(func) and has_root_block(func):
                mod[global_var] = with_dims_known_non_negative(
                    schedule_prim_func(func, min_parallel_work))
        return mod


def schedule_prim_func(func: tirx.PrimFunc,
                       min_parallel_work: int = DEFAULT_MIN_PARALLEL_WORK) -> tirx.PrimFunc:
    inlined = s_tir.Schedule(func)
    _inline_injective_blocks(inlined)
    versions = []
    for parallel, condition in parallel_buckets(loop_work(inlined), min_parallel_work):
        schedule = inlined.copy()  # a copy costs far less than a new Schedule's analysis
        if parallel:
            parallelize_outer_loops(schedule)
        fuse_contiguous_reduction_loops(schedule)
        fuse_static_inner_loops(schedule)
        initialize_before_reduction_loops(schedule)
        versions.append((condition, schedule.mod["main"]))
    return join_versions(versions).with_attr("tirx.is_scheduled", True)


def parallelize_outer_loops(schedule: s_tir.Schedule, skip: frozenset[str] = frozenset()) -> None:
    """Fuse and parallelize the leading spatial loops of every top-level loop nest still serial
    (blocks named in `skip` have their own schedule)."""
    root = schedule.get_sblock("root")
    for block in schedule.get_child_blocks(root):
        if schedule.get(block).name_hint in skip or SERIAL in schedule.get(block).annotations:
            continue
        loops = schedule.get_loops(block)
        if any(_is_empty(schedule.get(loop).extent) for loop in loops):
            continue  # an empty tensor: nothing runs, and fusing would divide by a zero extent
        count = min(MAX_FUSED_LOOPS, _leading_spatial_loop_count(schedule, block, loops))
        if count == 0:
            continue
        fused = schedule.fuse(*loops[:count]) if count > 1 else loops[0]
        extent = schedule.get(fused).extent
        if isinstance(extent, tirx.IntImm) and extent.value < MIN_PARALLEL_EXTENT:
            continue
        schedule.parallel(fused)


def fuse_contiguous_reduction_loops(schedule: s_tir.Schedule) -> None:
    """Fuse the innermost reduction loops of each top-level reduction block into one loop where
    every buffer the block reads is indexed, in its trailing dims, by exactly those loops' block
    iterators over the whole dim: the fused loop then walks one contiguous run, and the indices
    TVM recovers from it by division simplify away. Elsewhere the divisions would stay."""
    analyzer = tvm.sym.Analyzer()
    root = schedule.get_sblock("root")
    for block in schedule.get_child_blocks(root):
        block_stmt = schedule.get(block)
        reduction_vars = _reduction_loop_vars(schedule, block)
        loops = _innermost_loops(schedule, block, lambda loop: any(
            loop.loop_var.same_as(var) for var in reduction_vars))
        if block_stmt.init is None or len(loops) < 2 or len(loops) != len(reduction_vars):
            continue
        reduced = [iter_var for iter_var in block_stmt.iter_vars if iter_var.iter_type != tirx.IterVar.DataPar]
        if len(reduced) == len(loops) and all(_reads_trailing_dims(region, reduced, analyzer)
                                              for region in block_stmt.reads
                                              if not region.source.same_as(block_stmt.writes[0].source)):
            schedule.fuse(*loops)


def fuse_static_inner_loops(schedule: s_tir.Schedule) -> None:
    """Fuse the innermost serial loops of static extent of each top-level elementwise block
    into one loop. Left as a nest, LLVM unrolls a short inner loop (the 16 columns of a
    16 x 16 map) and then vectorizes the loop around it, with gathers and scatters at a
    stride of a row: an add of two 3 x 8 x 16 x 16 tensors took 4.5 us. Fused, the loop walks
    the trailing dims in memory order (the indices recovered from it by division by constants
    simplify back to the flat offset), and LLVM vectorizes it contiguously.

    Only where the flat offset of every element the block reads is linear in those loops'
    iterators: a gather's computed indices (a nearest-neighbour resize reads row h / 2) do not
    simplify back, and each element then paid the divisions that recover its indices from the
    fused loop. detector_fpn compiled for a static 1x3x32x48 fused its two
    2x upsamplings and their concat into one such loop: 12.5 us, against 5.4 us for the same
    three ops as kernels of their own over its symbolic plane."""
    root = schedule.get_sblock("root")
    for block in schedule.get_child_blocks(root):
        if _is_reduction(schedule, block):
            continue
        static_loops = _innermost_loops(schedule, block, lambda loop: (
            loop.kind == tirx.ForKind.SERIAL and isinstance(loop.extent, tirx.IntImm)))
        # an empty tensor: nothing runs, and fusing would divide by the zero extent
        if (len(static_loops) >= 2 and not any(_is_empty(schedule.get(loop).extent) for loop in static_loops)
                and _reads_linearly(schedule, block, static_loops)):
            schedule.fuse(*static_loops)


def _reads_linearly(schedule: s_tir.Schedule, block, loops: list) -> bool:
    """Whether each element `block` reads is one known element (a region of one element: TVM
    widens the region of a read whose indices it cannot analyze) whose flat offset is linear
    in the iterators bound to `loops` (elementwise, broadcast, transposed, sliced and reshaped
    reads are; a gather's computed indices are not)."""
    loop_vars = {schedule.get(loop).loop_var for loop in loops}
    realize = _get_sblock_realize(schedule, block)
    inner = [iter_var.var for iter_var, binding in zip(realize.block.iter_vars, realize.iter_values)
             if any(var in loop_vars for var in tirx.analysis.undefined_vars(binding))]
    analyzer = tvm.sym.Analyzer()
    for region in schedule.get(block).reads:
        offset = tirx.const(0, "int64")
        for span, extent in zip(region.region, region.source.shape):
            if not analyzer.can_prove_equal(span.extent, 1):
                return False
            offset = offset * extent + span.min
        if not tvm.sym.detect_linear_equation(analyzer.simplify(offset), inner):
            return False
    return True


def _innermost_loops(schedule: s_tir.Schedule, block, qualifies) -> list:
    """The innermost loops of `block`, outermost first, up to the first (from inside) whose
    statement does not satisfy `qualifies`."""
    loops = schedule.get_loops(block)
    count = 0
    while count < len(loops) and qualifies(schedule.get(loops[len(loops) - 1 - count])):
        count += 1
    return list(loops[len(loops) - count:])


def _reads_trailing_dims(region, reduced: list, analyzer) -> bool:
    """Whether `region` spans its buffer's last dims whole, indexed by `reduced` in order."""
    trailing = list(region.region)[-len(reduced):]
    shape = list(region.source.shape)[-len(reduced):]
    return len(trailing) == len(reduced) and all(
        isinstance(span.min, tirx.Var) and span.min.same_as(iter_var.var) and analyzer.can_prove_equal(span.extent, 1)
        and analyzer.can_prove_equal(extent, iter_var.dom.extent) and analyzer.can_prove_equal(iter_var.dom.min, 0)
        for span, iter_var, extent in zip(trailing, reduced, shape))


def initialize_before_reduction_loops(schedule: s_tir.Schedule) -> None:
    """Give every top-level reduction block its init as a block of its own, before the
    outermost reduction loop, so that it runs even when the reduction is empty."""
    root = schedule.get_sblock("root")
    for block in schedule.get_child_blocks(root):
        if schedule.get(block).init is None:
            continue
        reduction_vars = _reduction_loop_vars(schedule, block)
        loops = [loop for loop in schedule.get_loops(block)
                 if any(schedule.get(loop).loop_var.same_as(var) for var in reduction_vars)]
        if loops:
            schedule.decompose_reduction(block, loops[0])


def _inline_injective_blocks(schedule: s_tir.Schedule) -> None:
    """Inline blocks into consumers (or producers) until no block can be inlined any more.

    A block is not inlined into a reduction: padding inlined into a convolution would evaluate
    its bounds check once per multiply-add instead of once per element (measured 2x slower).
    A block annotated MATERIALIZED is not inlined, nor its consumers into it.
    The schedule primitives check legality themselves (an output block, a reduction or a
    non-injective access is refused with a ScheduleError), so trying is the test, except for
    what they cannot see: a block whose buffer an opaque block (TOPI's IR-builder kernels,
    which declare no reads and writes) reads or writes stays, as NonMaxSuppression's sorted
    scores, which its loop overwrites.
    """
    changed = True
    while changed:
        changed = False
        root = schedule.get_sblock("root")
        opaque = _opaquely_accessed(schedule, root)
        for block in schedule.get_child_blocks(root):
            if _materialized(schedule, block) or any(
                    region.source.same_as(var) for region in schedule.get(block).writes for var in opaque):
                continue
            inlines = []
            if not any(_is_reduction(schedule, consumer) for consumer in schedule.get_consumers(block)):
                inlines.append(schedule.compute_inline)
            if not any(_materialized(schedule, producer) for producer in schedule.get_producers(block)):
                inlines.append(schedule.reverse_compute_inline)
            for inline in inlines:
                try:
                    inline(block)
                except s_tir.ScheduleError:
                    continue
                changed = True
                break
            if changed:
                break


def _opaquely_accessed(schedule: s_tir.Schedule, root) -> list:
    """The buffers the root's opaque blocks use (a list: a TIR variable's
    `==` builds an expression)."""
    used = []
    for block in schedule.get_child_blocks(root):
        stmt = schedule.get(block)
        if not stmt.reads and not stmt.writes:
            used.extend(tirx.analysis.undefined_vars(stmt.body))
    return used


def _materialized(schedule: s_tir.Schedule, block) -> bool:
    return MATERIALIZED in schedule.get(block).annotations


def _is_reduction(schedule: s_tir.Schedule, block) -> bool:
    return any(iter_var.iter_type != tirx.IterVar.DataPar for iter_var in schedule.get(block).iter_vars)


def _leading_spatial_loop_count(schedule: s_tir.Schedule, block, loops) -> int:
    """How many outer loops of `block` can run in parallel as one fused loop.

    A loop qualifies while it is serial, none of the block's reduction iterators reads its
    variable, and it wraps a single statement (fusing past a loop that holds several nests would
    interleave them). The first loop with several children may still be fused as the last one.
    """
    reduction_vars = _reduction_loop_vars(schedule, block)
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


def _reduction_loop_vars(schedule: s_tir.Schedule, block) -> set:
    """The loop variables that `block`'s reduction iterators are bound to."""
    realize = _get_sblock_realize(schedule, block)
    reduction_vars = set()
    for iter_var, binding in zip(realize.block.iter_vars, realize.iter_values):
        if iter_var.iter_type != tirx.IterVar.DataPar:
            reduction_vars.update(tirx.analysis.undefined_vars(binding))
    return reduction_vars


_get_sblock_realize = tvm.get_global_func("s_tir.schedule.GetSBlockRealize")


def _is_empty(extent) -> bool:
    return isinstance(extent, tirx.IntImm) and extent.value == 0


def has_root_block(func: tirx.PrimFunc) -> bool:
    """Whether `func` is loop nests under a root block (library kernels such as sort and scan
    are one opaque block instead)."""
    return isinstance(func.body, s_tir.SBlockRealize) and func.body.block.name_hint == "root"


def is_scheduled(func: tirx.PrimFunc) -> bool:
    return func.attrs is not None and bool(func.attrs.get("tirx.is_scheduled", False))
