"""Schedule every fused PrimFunc that holds a tightfit kernel, one version per shape bucket.

DESIGN.md step 12. The kernels come from passes/select_conv_algorithm.py and
passes/select_gemm_kernel.py, which emit TE computes whose tiles block carries its kind and
knobs as block annotations (register_tile.py); FuseTIR keeps block annotations, so after fusion
this pass finds the tiles block, inlines the fused elementwise epilogue into the kernel's
write-back, schedules each shape bucket of dispatch.py, and joins the versions with an `if` on
the run-time extent. Each row version comes serial and parallel where the kernel's work may
fall below the parallel threshold (dispatch.parallel_buckets), the serial one made from the
parallel one (dispatch.serial_twin). Winograd's transform kernels
have no register tiles, so only those two versions (winograd.py). A last-axis softmax or layer
norm gets the row kernel of row_kernels.py, a max pool the vector kernel of pool_kernels.py, an
attention that FuseAttention marked the kernel of attention.py.
PrimFuncs without a kernel block are left to the fallback schedule.
"""

from __future__ import annotations

import functools
import operator

import tvm
from tvm import s_tir, tirx

from . import conv2d, direct_depthwise, gemm, winograd
from .attention import schedule_attention
from .dispatch import (
    DEFAULT_MIN_PARALLEL_WORK,
    combine,
    join_versions,
    loop_work,
    parallel_buckets,
    row_buckets,
    run_first_where,
    serial_twin,
    with_dims_known_non_negative,
)
from .fallback_cpu import has_root_block, is_scheduled, parallelize_outer_loops
from .isa import TILE_SCOPE, VectorISA, isa_for_target
from .knob_database import KnobDatabase
from .pool_kernels import schedule_max_pool
from .register_tile import (
    KERNEL_ANNOTATION,
    REDUCTION_UNROLL_ANNOTATION,
    ROW_TILES,
    ROWS_ANNOTATION,
    SHORT_ROW_TILES,
    SHORT_TILE_ROWS,
    SINGLE_ROW,
    STAGE_ANNOTATION,
    SYMBOLIC_COLUMNS,
    VECTORS_ANNOTATION,
    TileKnobs,
    apply_rewrites,
    schedule_register_tiles,
    short_tile_knobs,
    single_row_knobs,
    version_slots,
)
from .row_kernels import schedule_row_kernel

# On a scheduled kernel: the extent its row versions dispatch on, from its own write-back
# (the function's output may be reshaped by its epilogue: a conv1d's squeeze)
ROW_EXTENT_ATTR = "tightfit.row_extent"
REGISTER_TILE_KERNELS = {conv2d.DIRECT, gemm.DENSE, gemm.MATMUL}
# the kernels whose tiles block is a register-tiled multiply-accumulate (dispatch.loop_work)
MAC_KERNELS = frozenset(REGISTER_TILE_KERNELS | {conv2d.WIDTH_VECTORS})


@tvm.transform.module_pass(opt_level=0, name="tightfit.ScheduleKernels")
class ScheduleKernels:
    """Schedule tightfit kernels (and mark them scheduled); leave every other PrimFunc alone."""

    def __init__(self, knob_database: str | None = None):
        self.knob_database = knob_database

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        target = tvm.target.Target.current(allow_none=True)
        isa = isa_for_target(target)
        min_parallel_work = KnobDatabase.open(self.knob_database, target).min_parallel_work()
        mod = mod.clone()
        for global_var, func in list(mod.functions.items()):
            if isinstance(func, tirx.PrimFunc) and not is_scheduled(func):
                scheduled = (schedule_kernel_func(func, isa, min_parallel_work)
                             or schedule_attention(func, isa, min_parallel_work)
                             or schedule_row_kernel(func, isa, min_parallel_work)
                             or schedule_max_pool(func, isa, min_parallel_work))
                if scheduled is not None:
                    mod[global_var] = with_dims_known_non_negative(scheduled)
        return mod


def schedule_kernel_func(func: tirx.PrimFunc, isa: VectorISA,
                         min_parallel_work: int = DEFAULT_MIN_PARALLEL_WORK) -> tirx.PrimFunc | None:
    """The scheduled, version-dispatching PrimFunc, or None when `func` holds no kernel.

    Each version schedules a copy of one Schedule of `func`: building a Schedule analyzes the
    whole function (6 ms for a conv over a symbolic map), a copy takes 0.02 ms."""
    if not has_root_block(func):
        return None
    base = s_tir.Schedule(func)
    found = find_kernel_block(base)
    if found is None:
        return None
    block_name, annotations = found
    kind = str(annotations[KERNEL_ANNOTATION])
    if kind in winograd.TRANSFORM_KERNELS:
        return _schedule_transform(base, block_name, annotations, isa, min_parallel_work)
    direct = _direct_kernel(base, block_name, annotations, isa, min_parallel_work)
    rows = int(annotations[ROWS_ANNOTATION])
    out_block = _single_consumer(base, base.get_sblock(block_name))
    out_buffer = base.get(out_block).writes[0].source
    row_extent, out_row_axis = conv2d.output_row_extent(out_buffer.shape, annotations)
    versions = []
    tiles_by_version = _version_tiles(base, block_name, annotations, isa)
    version_buckets = row_buckets(row_extent, rows,
                                  SHORT_TILE_ROWS if kind in REGISTER_TILE_KERNELS else None,
                                  _version_slots(base, block_name, kind, tiles_by_version, isa))
    if annotations.get(conv2d.CHANNEL_VECTORS_ANNOTATION):
        channels = int(base.get(base.get_sblock(block_name)).iter_vars[1].dom.extent)
        _, tile_pixels = conv2d.channel_vector_tile(isa, channels)
        version_buckets = conv2d.channel_vector_buckets(row_extent, tile_pixels)
    work_buckets = parallel_buckets(loop_work(base, MAC_KERNELS), min_parallel_work)
    buckets = [(version, parallel, combine(row_condition, work_condition))
               for version, row_condition in version_buckets
               for parallel, work_condition in work_buckets]
    # row version -> (its parallel schedule, its rewrites): the serial twin is made before the
    # rewrites and gets them anew, as they add match buffers, which two versions may not share
    parallel_schedules: dict[str, tuple[tirx.PrimFunc, list]] = {}
    for version, parallel, condition in buckets:
        if not parallel and version in parallel_schedules:
            scheduled, rewrites = parallel_schedules[version]
            versions.append((condition, apply_rewrites(serial_twin(scheduled), rewrites)))
            continue
        sch = base.copy()
        tiles = sch.get_sblock(block_name)
        out_block = inline_epilogue(sch, _single_consumer(sch, tiles))
        if conv2d.FLAT_PIXELS_ANNOTATION in annotations:
            conv2d.flatten_output_pixels(sch, out_block)
        if kind in REGISTER_TILE_KERNELS:
            rewrites = schedule_register_tiles(sch, tiles, out_block, row_extent, out_row_axis,
                                               tiles_by_version[version], isa, version, parallel)
            if kind == gemm.MATMUL:
                rewrites.append(("pack_panels", gemm.RHS_PANELS))
        elif kind == conv2d.WIDTH_VECTORS:
            rewrites = conv2d.schedule_width_vectors(
                sch, tiles, out_block, row_extent, out_row_axis,
                int(annotations[conv2d.CHANNEL_ROWS_ANNOTATION]),
                int(annotations[VECTORS_ANNOTATION]), isa, version, parallel)
        elif kind == conv2d.DEPTHWISE:
            rewrites = conv2d.schedule_depthwise(
                sch, tiles, out_block, row_extent, out_row_axis, rows,
                int(annotations[conv2d.DEPTHWISE_ROWS_ANNOTATION]), version, parallel)
        else:
            raise ValueError(f"no schedule for kernel kind {kind!r} (block {block_name})")
        conv2d.gather_channels_in_blocks(sch)
        _tiles_in_tile_scope(sch, tiles)
        if parallel:
            parallelize_outer_loops(sch, skip=_kernel_block_names(sch, block_name, out_block))
            parallel_schedules[version] = (sch.mod["main"], rewrites)
        versions.append((condition, apply_rewrites(sch.mod["main"], rewrites)))
    joined = join_versions(versions)
    if direct is not None:
        joined = run_first_where(joined, *direct)
    return joined.with_attr("tirx.is_scheduled", True).with_attr(ROW_EXTENT_ATTR, row_extent)


def _tiles_in_tile_scope(sch: s_tir.Schedule, tiles) -> None:
    """The kernel's tiles in TILE_SCOPE (isa.py), where the kernel allocates them: a Winograd
    input transform writes its tiles to its output, a parameter."""
    written = sch.get(tiles).writes[0].source
    if not any(written.same_as(param) for param in sch.mod["main"].params):
        sch.set_scope(tiles, 0, TILE_SCOPE)


def _direct_kernel(base: s_tir.Schedule, block_name: str, annotations: dict,
                   isa: VectorISA, min_parallel_work: int) -> tuple[object, tirx.Stmt] | None:
    """(condition, body) of a depthwise conv's direct kernels, which read the input without
    packing it (direct_depthwise.py), or None where none applies. Only where masked loads are
    fast: their edge vectors are masked (NEON loads them lane by lane)."""
    if str(annotations[KERNEL_ANNOTATION]) != conv2d.DEPTHWISE or not isa.fast_masks:
        return None
    sch = base.copy()
    tiles = sch.get_sblock(block_name)
    window = [int(value) for value in annotations[conv2d.DEPTHWISE_WINDOW_ANNOTATION]]
    return direct_depthwise.direct_kernel(
        sch, tiles, inline_epilogue(sch, _single_consumer(sch, tiles)), window, isa.lanes,
        isa.registers, loop_work(base, MAC_KERNELS), min_parallel_work)


def _version_tiles(base: s_tir.Schedule, block_name: str, annotations: dict,
                   isa: VectorISA) -> dict[str, TileKnobs]:
    """A register-tile kernel's tile in each row version (register_tile.py); {} for the other
    kernels."""
    kind = str(annotations[KERNEL_ANNOTATION])
    if kind not in REGISTER_TILE_KERNELS:
        return {}
    knobs = TileKnobs(int(annotations[ROWS_ANNOTATION]), int(annotations[VECTORS_ANNOTATION]),
                      int(annotations.get(REDUCTION_UNROLL_ANNOTATION, 1)))
    columns = _tile_columns(base, block_name)
    return {ROW_TILES: knobs, SHORT_ROW_TILES: short_tile_knobs(knobs, columns, isa),
            SINGLE_ROW: single_row_knobs(knobs, columns, isa, chained=kind != conv2d.DIRECT)}


def _version_slots(base: s_tir.Schedule, block_name: str, kind: str, tiles_by_version: dict,
                   isa: VectorISA):
    """register_tile.version_slots of a register-tile kernel's versions over its tiles' columns
    (a symbolic count, attention's scores over the tokens, as the SYMBOLIC_COLUMNS the tile was
    sized for); None for the other kernels. A direct conv's single rows are not costed: each
    re-reads the whole weight, which the slots do not count (register_tile.short_tile_knobs:
    3.5x the 4-row tiles' time at 4x4).

    GEMMs too, not only direct convs: a 16-token sequence took two 15-row tiles, computing 30
    rows. Whole runs, one process, median of 15 alternating turns, GEMMs with the cost's choice
    against ROW_TILES from a tile's rows on: transformer_encoder_dynamo 3x16 36.99 -> 30.34 us,
    transformer_encoder 3x16 42.81 -> 36.39 us, torch_transformer_layers 3x12 31.41 -> 29.69
    us, transformer_encoder_wide 4x32 2256 -> 2103 us; within 1% at 1x5, 2x33 and 1x128 (and at
    1x5 both ran short tiles already), speech_encoder_dynamo within 2.5%. ResNet-18's Winograd
    GEMMs (rows: tiles of the map), summed, each alone, median of 5: 1x3x128x128 403 -> 335 us,
    2x3x96x112 674 -> 619 us; MobileNetV2's GEMMs and the CNNs of the zoo within 1%."""
    if not tiles_by_version:
        return None
    columns = _tile_columns(base, block_name)
    columns = int(columns) if isinstance(columns, tirx.IntImm) else SYMBOLIC_COLUMNS
    costed = set(tiles_by_version) - ({SINGLE_ROW} if kind == conv2d.DIRECT else set())

    def slots(version: str, row_extent):
        if version not in costed:
            return None
        return version_slots(row_extent, tiles_by_version[version], columns, isa)

    return slots


def _tile_columns(base: s_tir.Schedule, block_name: str):
    """The extent of a tiles block's columns: its last spatial axis."""
    spatial = [iv for iv in base.get(base.get_sblock(block_name)).iter_vars
               if iv.iter_type == tirx.IterVar.DataPar]
    return spatial[-1].dom.extent


def _schedule_transform(base: s_tir.Schedule, block_name: str, annotations: dict, isa: VectorISA,
                        min_parallel_work: int) -> tirx.PrimFunc:
    """A Winograd transform kernel: no register tiles, so only the serial/parallel versions
    (the serial one the parallel one's `serial_twin`)."""
    versions = []
    for parallel, condition in parallel_buckets(loop_work(base), min_parallel_work):
        if not parallel and versions:
            versions.append((condition, serial_twin(versions[-1][1])))
            continue
        sch = base.copy()
        tiles = sch.get_sblock(block_name)
        if annotations[KERNEL_ANNOTATION] == winograd.WINOGRAD_INPUT:
            winograd.schedule_input_transform(sch, tiles, isa, parallel)
            kernel_blocks = frozenset({block_name})
        else:
            out_block = inline_epilogue(sch, _single_consumer(sch, tiles))
            winograd.schedule_output_transform(sch, tiles, out_block,
                                               int(annotations[winograd.TILE_ANNOTATION]), isa,
                                               parallel)
            kernel_blocks = frozenset({block_name, sch.get(out_block).name_hint})
        conv2d.gather_channels_in_blocks(sch)
        _tiles_in_tile_scope(sch, tiles)
        if parallel:
            parallelize_outer_loops(sch, skip=kernel_blocks)
        versions.append((condition, sch.mod["main"]))
    return join_versions(versions).with_attr("tirx.is_scheduled", True)


def find_kernel_block(sch: s_tir.Schedule) -> tuple[str, dict] | None:
    """The name and annotations of the tiles block of the function `sch` schedules, if any."""
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        stmt = sch.get(block)
        annotations = dict(stmt.annotations)
        if KERNEL_ANNOTATION in annotations:
            return stmt.name_hint, annotations
    return None


def inline_epilogue(sch: s_tir.Schedule, out_block):
    """Inline the chain of elementwise consumers of `out_block` into it (bias, BN, activation,
    residual add), so the values go from registers to the final output in one store.

    An epilogue that reads a value twice (GELU: x * 0.5 * (1 + erf(x / sqrt 2)) reads x in
    its first and last op) is a graph, not a chain: its inner blocks are first inlined forward
    into their consumers, which leaves one block reading the write-back. Stops at the first
    consumer that cannot be inlined (a reduction); those are scheduled as ordinary blocks
    afterwards, as are the inner blocks that could not be inlined forward.
    """
    _inline_forward_after(sch, out_block)
    while True:
        consumers = sch.get_consumers(out_block)
        if (len(consumers) != 1 or STAGE_ANNOTATION in sch.get(consumers[0]).annotations
                or not _writes_as_many(sch, consumers[0], out_block)):
            return out_block
        try:
            sch.reverse_compute_inline(consumers[0])
        except s_tir.ScheduleError:
            return out_block


def _writes_as_many(sch: s_tir.Schedule, consumer, producer) -> bool:
    """Whether `consumer` writes as many elements as `producer` (a transposed or reshaped copy
    of them, or the same shape). One that broadcasts the product up (a [1,h,q,k] matmul plus a
    [b,h,q,k] mask) visits each product more than once, so it cannot become the producer's
    store; TVM's reverse_compute_inline fails on it with an internal error, not a
    ScheduleError."""
    def elements(block):
        return functools.reduce(operator.mul, sch.get(block).writes[0].source.shape, 1)
    return tvm.sym.Analyzer().can_prove_equal(elements(consumer), elements(producer))


def _inline_forward_after(sch: s_tir.Schedule, out_block) -> None:
    """compute_inline every block downstream of `out_block` that writes an intermediate buffer
    (not one of the function's outputs) and is not a packing stage; blocks that cannot be
    inlined (reductions) stay."""
    parameters = [param for param in sch.mod["main"].params if hasattr(param, "shape")]
    pending, seen = list(sch.get_consumers(out_block)), set()
    while pending:
        block = pending.pop(0)
        name = sch.get(block).name_hint
        if name in seen:
            continue
        seen.add(name)
        consumers = list(sch.get_consumers(block))
        writes_output = any(region.source.same_as(param) for region in sch.get(block).writes
                            for param in parameters)
        if not writes_output and STAGE_ANNOTATION not in sch.get(block).annotations:
            try:
                sch.compute_inline(block)
            except s_tir.ScheduleError:
                pass
        pending += consumers


def _kernel_block_names(sch: s_tir.Schedule, tiles_name: str, out_block) -> frozenset[str]:
    """The kernel's own blocks: its tiles (update and init) and the write-back under them."""
    names = {sch.get(block).name_hint for block in sch.get_child_blocks(sch.get_sblock("root"))}
    return frozenset({name for name in names if name.startswith(tiles_name)}
                     | {sch.get(out_block).name_hint})


def _single_consumer(sch: s_tir.Schedule, block):
    consumers = sch.get_consumers(block)
    if len(consumers) != 1:
        raise ValueError(f"kernel block {sch.get(block).name_hint} must have one consumer, "
                         f"has {len(consumers)}")
    return consumers[0]

