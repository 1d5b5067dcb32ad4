"""The register-tile GEMM schedule that every compute-bound tightfit kernel shares.

A kernel compute (schedules/gemm.py, schedules/conv2d.py) ends in a
*tiles* block  T[*batch, row, col] = sum_r A(row, r) * B[col-panel, r, col-lane]  (B packed
offline in panels of NB = vectors x lanes columns) and an *out* block that copies T into the
model's layout; elementwise epilogues fused after it (bias, BN, ReLU, residual add) are inlined
into the out block. This module turns that into the classic micro-kernel (Goto/BLIS, as MNN's
and XNNPack's CPU kernels):

    parallel for (*batch, row tile):            # or (*batch, column panel) when rows are few
      for column panel:                         # (panels outermost instead: see below)
        acc[rows][vectors] = 0                  # registers: rows x vectors accumulators
        for r in reduction:                     # A broadcast, B vectors loaded once per r
          acc[i][v] += A(row_i, r) * B[panel, r, v]
        out[...] = epilogue(acc)                # written straight from registers

A dense kernel whose packed weight outgrows ROW_TILES_OUTER_MAX_WEIGHT_BYTES, or whose rows are
one tile, runs the column panels outermost (parallel), so that each panel of B is read from
memory once and stays in L2 while every row tile uses it.

Three versions cover a symbolic row extent M (dispatch.py picks at run time):
- ROW_TILES (M >= rows): `rows` rows per tile, the last tile shifted back (tail_tiles.py);
- SHORT_ROW_TILES (SHORT_TILE_ROWS <= M < rows; a conv's 4- to 14-wide maps, a GEMM over a
  few tokens; and longer rows where they cost less, version_slots): the same with short
  tiles (short_tile_knobs);
- SINGLE_ROW (M below that; a GEMV-like skinny GEMM, a map a pixel or two wide; and a GEMM's
  rows where it costs less than short tiles that compute rows twice, version_slots): one row
  at a time, parallel over column panels, the row loop cut to M.
A static row extent smaller than the register budget's tile (a GEMV-like layer) gets wider
panels instead, up to SKINNY_VECTORS vectors (default_tile_knobs).
Limits: fp32; the reduction is not blocked for the cache (fine while one B panel, K x NB
floats, fits in L2: K <= 8192 at NB = 32); software prefetch only of a direct conv's large
weight (PREFETCH_WEIGHT_ANNOTATION; prefetch.py says where it did not pay).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import tvm
from tvm import s_tir, tirx

from .isa import VectorISA
from .padding import vector_packing_rows, vector_panel_rows
from .prefetch import prefetch_channels_ahead
from .row_chunks import masked_row_write_back
from .tail_tiles import restrict_loop, shift_tail_tile

KERNEL_ANNOTATION = "tightfit.kernel"
ROWS_ANNOTATION = "tightfit.rows"
VECTORS_ANNOTATION = "tightfit.vectors"
# the innermost reduction loop unrolled by this factor (TileKnobs.reduction_unroll)
REDUCTION_UNROLL_ANNOTATION = "tightfit.reduction_unroll"
# Which axis of the out block's buffer holds the row extent M (the tiles' row axis).
OUTPUT_ROW_AXIS_ANNOTATION = "tightfit.output_row_axis"
# Blocks a kernel wants materialized (packing stages), never inlined by the epilogue inliner.
STAGE_ANNOTATION = "tightfit.stage"
# On a tiles block: the bytes of the packed weight it reads (dense and pointwise kernels), for
# the loop order.
WEIGHT_BYTES_ANNOTATION = "tightfit.weight_bytes"
# On a tiles block: prefetch its packed weight (`tile_operands`) steps of the innermost
# reduction loop ahead (prefetch.py; a direct conv's large weight: conv2d.conv2d_direct).
PREFETCH_WEIGHT_ANNOTATION = "tightfit.prefetch_weight"

ROW_TILES = "row_tiles"
SHORT_ROW_TILES = "short_row_tiles"
SINGLE_ROW = "single_row"

# A parallel loop with fewer iterations than this runs serially: waking the pool costs more.
MIN_PARALLEL_EXTENT = 2


@dataclass(frozen=True)
class TileKnobs:
    rows: int  # rows of the register tile (ROW_TILES version)
    vectors: int  # vector registers across a column panel; NB = vectors * lanes
    reduction_unroll: int = 1  # innermost reduction loop unrolled by this factor


MAX_ROWS = 16
# A kernel's loop order re-reads one operand per tile of the other: tiles of rows outermost
# re-read the weights once per row tile, column panels outermost the rows once per panel.
# Weights up to this size stay in L2 (1 MB per core here) beside the activations, so they are
# re-read there; larger ones go outermost. Measured on MobileNetV2's pointwise convs: 3-5%
# faster whole runs at 1x3x224x224 and 2x3x160x128 than pixel tiles outermost everywhere.
ROW_TILES_OUTER_MAX_WEIGHT_BYTES = 128 << 10
# Vectors across a skinny GEMM's panel (fewer rows than a tile): the independent accumulator
# chains that hide the FMA latency (two pipes x four cycles) where the rows are too few to.
SKINNY_VECTORS = 8
# The column count a symbolic one is tiled for (SelectGemmKernel) and searched under
# (knob_search): 16, one AVX-512 vector (four NEON ones). Attention's scores (tokens x tokens)
# are the case; 32-wide panels did twice the work at 16 tokens and 6x at 5
# (transformer_encoder_dynamo's Q.K^T kernel, one process: 1x5 tokens 1.14 -> 0.59 us, 3x16
# 4.1 -> 2.4 us, 2x33 7.3 -> 6.8 us; at 1x128 12-14 us either way).
SYMBOLIC_COLUMNS = 16
# Rows of the SHORT_ROW_TILES version's tile (short_tile_knobs): the narrowest maps it covers.
SHORT_TILE_ROWS = 4


def default_tile_knobs(isa: VectorISA, columns: int, row_extent,
                       panel_width: int | None = None) -> TileKnobs:
    """The register budget's tile: as many accumulators as fit, no wider than the columns.

    Start from `vectors` = 2 (AVX-512, AVX2) or 4 (NEON: 4-lane registers, 16-wide panels), or
    from `panel_width` columns when the kernel gives one; fewer when the output has fewer
    columns (16 output channels need one AVX-512 vector, not a half-empty second). Rows are the most that `isa.fits_registers` allows (registers, and the
    stack-array limit), capped at MAX_ROWS. When the row extent is a known number, the rows are
    instead the ones, from half that height up, with the least `tile_cost` over the extent: tiles
    cover it with the last one shifted back, so rows that do not divide it compute some rows
    twice (a 32-pixel-wide conv in 15-row tiles computes 45). A known extent below the tile's
    rows is the tile's height, and where the panel width is ours to choose (a GEMM, not a conv
    whose weights have a fixed panel) the freed registers go to vectors, up to SKINNY_VECTORS:
    each is an independent chain of multiply-adds, and one row of two vectors waited on the FMA
    latency (MobileNetV2's 1280 -> 1000 classifier at batch 1: 183 -> 65 us with the panels
    sharing the threads). A conv's fixed panels are read several at a time instead, as the
    short tiles do (`chained_vectors`): ResNet-18 at a static 1x3x128x128 ran its 512 -> 512
    3x3 convs at 4x4 in 4 x 1 tiles, 293 us each alone, where the same convs over a symbolic
    plane took 184 us in 4 x 2 short tiles.
    """
    preferred = max(1, panel_width // isa.lanes) if panel_width else (4 if isa.lanes == 4 else 2)
    column_vectors = max(1, -(-columns // isa.lanes))
    vectors = min(preferred, column_vectors)
    rows = max([r for r in range(1, MAX_ROWS + 1) if isa.fits_registers(r, vectors)], default=1)
    if isinstance(row_extent, (int, tirx.IntImm)):
        extent = int(row_extent)
        if extent < rows and panel_width is None:
            skinny = [v for v in range(vectors, min(SKINNY_VECTORS, column_vectors) + 1)
                      if isa.fits_registers(max(1, extent), v)]
            return TileKnobs(rows=max(1, extent), vectors=max(skinny, default=vectors))
        if extent < rows:
            rows = max(1, extent)
            return TileKnobs(rows=rows, vectors=chained_vectors(rows, vectors, columns, isa))
        rows = min(range(max(1, rows // 2), rows + 1),
                   key=lambda r: (-(-extent // r) * tile_cost(r, vectors), -r))
    return TileKnobs(rows=rows, vectors=vectors)


def short_tile_knobs(knobs: TileKnobs, columns, isa: VectorISA) -> TileKnobs:
    """The SHORT_ROW_TILES tile: SHORT_TILE_ROWS rows, and `chained_vectors` across.

    One row at a time (SINGLE_ROW) a tile has only `vectors` chains and loads a vector of the
    weights per multiply-add, and a conv re-reads its weights from L2 for every pixel. ResNet-18's
    256 -> 512 stride-2 conv over a symbolic plane, alone, 2 threads, one pixel at a time ->
    4 x 2 tiles (panels outermost, `_panels_outermost`), onnxruntime in the same process:
    4x4 output 1046-1184 -> 298-306 us (onnxruntime 297-338), 8x8 2000-4100 -> 1150-1170 us
    (1020-1030), 3x4 810-850 -> 244-272 us (241-260).
    """
    return replace(knobs, rows=SHORT_TILE_ROWS,
                   vectors=chained_vectors(SHORT_TILE_ROWS, knobs.vectors, columns, isa))


def single_row_knobs(knobs: TileKnobs, columns, isa: VectorISA, chained: bool) -> TileKnobs:
    """The SINGLE_ROW tile: one row, across `knobs.vectors`, or `chained_vectors` where
    `chained`. GEMMs chain: their weights stay in L1 or L2 while rows re-read them, and one row
    of two vectors waited on the multiply-add latency. A direct conv does not: its weights can
    be megabytes, re-read from memory for every row.

    With GEMMs' single rows chained and costed against short tiles (version_slots), one
    process, medians of 5-7 alternating profiles, whole runs: torch_transformer_layers 1x5x32
    6.85 -> 5.88 us (its QKV GEMM over 5 x 1 x 32, one row per batch entry, 1.03 -> 0.32 us),
    3x12x32 27.57 -> 25.19 us; transformer_encoder_dynamo 1x5 6.12 -> 5.73 us (GEMMs of 5 x 32
    x 96 and x 64 0.43 / 0.49 -> 0.32 / 0.33 us); every kernel of transformer_encoder at 3x16
    and 2x33, speech_encoder_dynamo, detector_fpn, conv_dynamic_hw, ResNet-18 and MobileNetV2
    within 4% alone, their kernels summed within 0.3%."""
    vectors = chained_vectors(1, knobs.vectors, columns, isa) if chained else knobs.vectors
    return replace(knobs, rows=1, vectors=vectors)


def version_slots(row_extent, tile: TileKnobs, columns: int, isa: VectorISA):
    """Issue slots (`tile_cost`, over the column panels) of one reduction step of `tile`'s
    tiles covering a row of `row_extent`: whole tiles, the last shifted back to compute some
    rows twice (a 16-wide row in 15-row tiles computes 30 rows, in 4-row ones 16). A number
    for a known extent, else an expression of it.

    Direct convs, ResNet-18's 64 -> 128 stride-2 conv over a symbolic plane, alone, one thread,
    output widths 15..31 (the maps as tall), 15-row tiles against 4 x 2 short tiles, us: 15:
    153 / 177, 16: 315 / 189, 20: 398 / 292, 24: 483 / 424, 26: 525 / 540, 28: 569 / 579, 30:
    609 / 700, 31: 926 / 733; the slots pick the faster one or a near tie (26, 28) at each.
    GEMMs, 4-row tiles against single rows of chained vectors, each alone, rows 4 to 14: over
    K x N = 64 x 96 at 5 / 6 / 9 rows 0.85 / 0.85 / 1.27 us against 0.63 / 0.75 / 1.12, at 8
    rows 0.85 against 1.00 (the slots pick each); over 32 x 32 and narrower the 4-row tiles
    won or tied at every count, and the slots pick them."""
    panels = -(-int(columns) // (tile.vectors * isa.lanes))
    tiles = (row_extent + tile.rows - 1) // tile.rows
    return tiles * panels * tile_cost(tile.rows, tile.vectors)


def chained_vectors(rows: int, vectors: int, columns, isa: VectorISA) -> int:
    """The most vectors, from `vectors` up to enough for a tile of `rows` rows to run
    SKINNY_VECTORS independent multiply-add chains, that the registers hold and that divide
    the columns, a known number, into whole panels (a direct conv's 16-wide weight panels are
    then read several at a time); `vectors` where none does."""
    if not isinstance(columns, (int, tirx.IntImm)):
        return vectors
    wanted = max(vectors, -(-SKINNY_VECTORS // rows))
    return max((v for v in range(vectors, wanted + 1)
                if int(columns) % (v * isa.lanes) == 0 and isa.fits_registers(rows, v)),
               default=vectors)


def weight_bytes(packed_weight, axes: int) -> int:
    """The bytes of the last `axes` axes of a packed weight (static shape): what one entry of
    any leading batch axes multiplies by, for WEIGHT_BYTES_ANNOTATION."""
    return (math.prod(int(d) for d in packed_weight.shape[-axes:])
            * tvm.runtime.DataType(str(packed_weight.dtype)).bits // 8)


def tile_cost(rows: int, vectors: int) -> int:
    """Issue slots of one reduction step of a tile: its multiply-adds or its loads (a broadcast
    per row, a vector of B per column vector), whichever is more, since a core issues about as
    many loads as FMAs per cycle (Zen, Cortex-A7x); plus one for the loop's own update and
    branch, which favours fewer, taller tiles when the rest ties."""
    return max(rows * vectors, rows + vectors) + 1


def schedule_register_tiles(sch: s_tir.Schedule, tiles_block, out_block, row_extent,
                            out_row_axis: int, knobs: TileKnobs, isa: VectorISA,
                            version: str, parallel: bool = True) -> list[tuple]:
    """Schedule tiles/out as the micro-kernel above, in `version`'s tile `knobs`
    (short_tile_knobs, single_row_knobs); returns the tail rewrites still to apply.
    `parallel` False keeps the outer loops serial (the small-work version, dispatch.py).

    The rewrites (`apply_rewrites`) change loop bounds and block bindings, which schedule
    primitives would reject afterwards, so they run last, on the finished PrimFunc.
    """
    loops = sch.get_loops(tiles_block)
    spatial_count = _spatial_iter_count(sch, tiles_block)
    spatial, reductions = loops[:spatial_count], loops[spatial_count:]
    batch, row, col = spatial[:-2], spatial[-2], spatial[-1]
    col_outer, col_vector, col_lane = sch.split(col, [None, knobs.vectors, isa.lanes])
    inner_reduction = _split_reduction(sch, reductions, knobs.reduction_unroll)
    if version in (ROW_TILES, SHORT_ROW_TILES):
        row_outer, row_inner = sch.split(row, [None, knobs.rows])
        if _panels_outermost(sch, tiles_block, batch, row_outer, col_outer, version):
            sch.reorder(col_outer, *batch, row_outer, *reductions, *inner_reduction, row_inner,
                        col_vector, col_lane)
            parallel_loops = [col_outer]
            write_back_at = row_outer
        else:
            sch.reorder(*batch, row_outer, col_outer, *reductions, *inner_reduction, row_inner,
                        col_vector, col_lane)
            # the short tiles' loop stays unfused, to be cut to the extent below
            parallel_loops = [*batch, row_outer] if version == ROW_TILES or not batch else batch
            write_back_at = col_outer
        unrolled = [row_inner, col_vector]
    else:
        sch.reorder(*batch, col_outer, row, *reductions, *inner_reduction, col_vector, col_lane)
        # A fused loop's parts are recovered by dividing by the extents inside it; a symbolic
        # panel count would put the tile at an offset TVM cannot prove constant, and the
        # accumulators in memory instead of registers (tests/schedules/test_register_tiles.py)
        panels_known = isinstance(sch.get(col_outer).extent, tirx.IntImm)
        parallel_loops = [*batch, col_outer] if panels_known or not batch else batch
        unrolled = [col_vector]
        write_back_at = row
    sch.reverse_compute_at(out_block, write_back_at)
    if parallel:
        _parallelize(sch, parallel_loops)
    for loop in unrolled + inner_reduction:
        sch.unroll(loop)
    sch.vectorize(col_lane)
    init_block = sch.decompose_reduction(tiles_block, reductions[0])
    _vectorize_write_back(sch, out_block, isa)
    prefetch = _prefetch_weight(sch, tiles_block, reductions[-1])
    if version in (ROW_TILES, SHORT_ROW_TILES):
        row_iters = {sch.get(tiles_block).name_hint: spatial_count - 2,
                     sch.get(init_block).name_hint: spatial_count - 2,
                     sch.get(out_block).name_hint: out_row_axis}
        # a write-back checking its columns (a symbolic or partial last panel) stores each row
        # with masked vector stores: TVM scalarizes a vector loop under a per-column check
        rewrites = [("shift", row_iters, knobs.rows, row_extent),
                    ("write_rows", sch.get(out_block).name_hint)] + prefetch
        if version == ROW_TILES:
            return rewrites
        # a direct conv's row domain is max(OW, rows) (conv2d.conv2d_direct): its short tiles
        # would otherwise run on past the extent, each repeating the shifted last tile
        return rewrites + [("restrict", sch.get(row_outer).loop_var,
                            tirx.floordiv(row_extent + knobs.rows - 1, knobs.rows))]
    return [("restrict", sch.get(row).loop_var, row_extent),
            ("write_rows", sch.get(out_block).name_hint)] + prefetch


def tile_operands(block) -> tuple[str, str]:
    """The names of the buffers a tiles block multiplies, (input, packed weight): its reads
    other than its own accumulators, in the order its value reads them."""
    own = block.writes[0].source.name
    data, weight = (region.source.name for region in block.reads if region.source.name != own)
    return data, weight


def _prefetch_weight(sch: s_tir.Schedule, tiles_block, reduction_loop) -> list[tuple]:
    """The prefetch rewrite of the tiles' packed weight along `reduction_loop` where the block
    asks for it (PREFETCH_WEIGHT_ANNOTATION)."""
    block = sch.get(tiles_block)
    if PREFETCH_WEIGHT_ANNOTATION not in block.annotations:
        return []
    _, weight = tile_operands(block)
    return [("prefetch", block.name_hint, sch.get(reduction_loop).loop_var, weight)]


def apply_rewrites(func: tirx.PrimFunc, rewrites: list[tuple]) -> tirx.PrimFunc:
    """Apply a schedule's rewrites of the finished PrimFunc, in order: ("shift", ...) shifts the
    last tile back (tail_tiles.shift_tail_tile), ("restrict", loop var, extent) cuts a loop
    (tail_tiles.restrict_loop), ("pack_rows", block name, lanes[, condition the version runs
    under]) writes a packing stage in vectors (padding.vector_packing_rows), ("pack_panels",
    block name) writes a panel packing stage in vectors (padding.vector_panel_rows),
    ("write_rows", block name) stores a checked write-back's rows with masked vector stores
    (row_chunks.masked_row_write_back), ("prefetch", block name, reduction loop var, buffer
    name) prefetches a buffer's reads channels ahead (prefetch.prefetch_channels_ahead)."""
    for rewrite in rewrites:
        if rewrite[0] == "shift":
            _, row_iters, rows, extent, *keep_checks = rewrite
            func = shift_tail_tile(func, row_iters, rows, extent, *keep_checks)
        elif rewrite[0] == "pack_rows":
            _, block_name, lanes, *version_condition = rewrite
            func = vector_packing_rows(func, block_name, lanes, *version_condition)
        elif rewrite[0] == "pack_panels":
            func = vector_panel_rows(func, rewrite[1])
        elif rewrite[0] == "write_rows":
            func = masked_row_write_back(func, rewrite[1])
        elif rewrite[0] == "prefetch":
            _, block_name, channel_var, buffer_name = rewrite
            func = prefetch_channels_ahead(func, block_name, channel_var, buffer_name)
        else:
            _, loop_var, extent = rewrite
            func = restrict_loop(func, loop_var, extent)
    return func


def _panels_outermost(sch: s_tir.Schedule, tiles_block, batch: list, row_outer,
                      col_outer, version: str) -> bool:
    """Column panels go outermost, and share the threads, where there are at least two of them
    and either the packed weight outgrows ROW_TILES_OUTER_MAX_WEIGHT_BYTES (with row tiles
    outermost every row tile streamed the whole weight again from beyond L2: BERT-base's
    768 -> 3072 GEMM at 128 tokens, 9.4 MB per tile of 7 rows; a direct conv annotates its
    weight only where its output rows are one tile: conv2d._one_tile_row_weight_bytes), or the
    rows are one tile (a GEMV-like layer would run on one thread), or the tiles are short ones
    (SHORT_ROW_TILES: a few rows)."""
    panels = sch.get(col_outer).extent
    if not isinstance(panels, tirx.IntImm) or panels.value < MIN_PARALLEL_EXTENT:
        return False
    if version == SHORT_ROW_TILES:
        return True
    weight_bytes = sch.get(tiles_block).annotations.get(WEIGHT_BYTES_ANNOTATION)
    if weight_bytes is not None and int(weight_bytes) > ROW_TILES_OUTER_MAX_WEIGHT_BYTES:
        return True
    row_tiles = [sch.get(loop).extent for loop in [*batch, row_outer]]
    if not all(isinstance(extent, tirx.IntImm) for extent in row_tiles):
        return False
    return math.prod(extent.value for extent in row_tiles) < MIN_PARALLEL_EXTENT


def _split_reduction(sch: s_tir.Schedule, reductions: list, unroll: int) -> list:
    """Split the innermost reduction loop by `unroll` when it divides evenly (else leave it)."""
    if unroll <= 1 or not reductions:
        return []
    extent = sch.get(reductions[-1]).extent
    if not isinstance(extent, tirx.IntImm) or extent.value % unroll != 0 or extent.value == unroll:
        return []
    outer, inner = sch.split(reductions[-1], [None, unroll])
    reductions[-1] = outer
    return [inner]


def _parallelize(sch: s_tir.Schedule, loops: list) -> None:
    if not loops:
        return
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    extent = sch.get(fused).extent
    if isinstance(extent, tirx.IntImm) and extent.value < MIN_PARALLEL_EXTENT:
        return
    sch.parallel(fused)


def _vectorize_write_back(sch: s_tir.Schedule, out_block, isa: VectorISA) -> None:
    """Vectorize the write-back's innermost loop when it is a whole number of vectors or at
    least half a vector (a conv's rows written along the output's width)."""
    loops = sch.get_loops(out_block)
    innermost = loops[-1]
    extent = sch.get(innermost).extent
    if not isinstance(extent, tirx.IntImm):
        return
    if extent.value % isa.lanes == 0 and extent.value > isa.lanes:
        _, lane = sch.split(innermost, [None, isa.lanes])
        sch.vectorize(lane)
    elif 2 * extent.value >= isa.lanes and extent.value <= isa.lanes:
        sch.vectorize(innermost)


def _spatial_iter_count(sch: s_tir.Schedule, block) -> int:
    iter_vars = sch.get(block).iter_vars
    return sum(1 for iv in iter_vars if iv.iter_type == tirx.IterVar.DataPar)
