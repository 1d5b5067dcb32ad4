"""Winograd convolution F(m x m, 3 x 3) as three kernels and an offline weight transform.

MNN §3.1 (Winograd among the pre-inference candidates) and Lavin & Gray, "Fast Algorithms for
Convolutional Neural Networks" (2016). A 3x3 stride-1 conv computes each m x m output tile from
an alpha x alpha input tile (alpha = m + 2) as

    Y = A^T [ (G g G^T) (.) (B^T d B) ] A

so the multiply-adds become alpha^2 independent GEMMs over channels, one per transform point:
- weights (offline, PreTransformWeights): U[point, k, c] = (G g_kc G^T)[point], packed into the
  dense kernel's panels, one weight matrix per point;
- `winograd_input`: V[n, tile row, tile column, point, c] = (B^T d_tile,c B)[point], the input
  read through a zero-padded channels-last copy so that the transform vectorizes over channels;
  the GEMM reads it with the tile row and column as one axis (a reshape, kept a view);
- the GEMM: M[n, tile, point, k] = sum_c V[n, tile, point, c] U[point, k, c], gemm.dense_packed
  with a weight per point, on register tiles (register_tile.py);
- `winograd_output`: Y[n, k, tile rows, tile cols] = (A^T M_tile,k A), vectorized over output
  channels, with the conv's epilogue (bias, activation, residual) fused into its write-back.
A tile's alpha^2 points are neighbours in V and M: with the point outermost, each transform
streamed alpha^2 vectors a tile a whole plane of tiles apart, and where that plane is a multiple
of 4 KB (64 channels over 8x8 or 16x16 tiles, 16 over 8x8) all of them fell into one set of the
L1 cache. Whole 64 -> 64 F(4,3) convs alone, 2 threads, point outermost -> inside (the packing
and write-back fixes in place both ways): 32x32 91 -> 70 us, 64x64 357 -> 252 us, symbolic
32x32 135 -> 93 us, 128 channels at 16x16 111 -> 82 us; 56x56 unchanged in whole runs.
F(2x2, 3x3) cuts the multiply-adds 2.25x, F(4x4, 3x3) 4x; the transforms cost memory traffic and
arithmetic per tile and channel, which conv_cost.py weighs against the savings. The matrices use
the points 0, +-1, +-2 and infinity; F(4x4, 3x3)'s are exact in fp32 up to rounding of 1/6 and
1/24 in G, so outputs differ from a direct conv's in the last bits, as onnxruntime's do.
Limits: 3x3 kernels, stride 1, dilation 1, groups 1, fp32.
"""

from __future__ import annotations

from fractions import Fraction

import tvm
from tvm import s_tir, te, tirx

from .conv2d import pack_input_channels_last
from .isa import VectorISA
from .register_tile import KERNEL_ANNOTATION, ROWS_ANNOTATION, STAGE_ANNOTATION

WINOGRAD_INPUT = "winograd_input"
WINOGRAD_OUTPUT = "winograd_output"
TRANSFORM_KERNELS = (WINOGRAD_INPUT, WINOGRAD_OUTPUT)
# Output tile side m -> (B^T, G, A^T), each a list of rows.
_F = Fraction
MATRICES = {
    2: ([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]],
        [[1, 0, 0], [_F(1, 2), _F(1, 2), _F(1, 2)], [_F(1, 2), _F(-1, 2), _F(1, 2)], [0, 0, 1]],
        [[1, 1, 1, 0], [0, 1, -1, -1]]),
    4: ([[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0],
         [0, -2, -1, 2, 1, 0], [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]],
        [[_F(1, 4), 0, 0], [_F(-1, 6), _F(-1, 6), _F(-1, 6)], [_F(-1, 6), _F(1, 6), _F(-1, 6)],
         [_F(1, 24), _F(1, 12), _F(1, 6)], [_F(1, 24), _F(-1, 12), _F(1, 6)], [0, 0, 1]],
        [[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]]),
}
TILE_ANNOTATION = "tightfit.winograd_tile"
# The widest channel vector the output transform writes back (schedule_output_transform).
OUTPUT_CHANNEL_LANES = 8


def combine(coefficients: list, values: list):
    """sum(c * v), spelled out with the zero terms left out and +-1 as additions."""
    total = None
    for coefficient, value in zip(coefficients, values):
        if coefficient == 0:
            continue
        scale = abs(coefficient)
        term = value if scale == 1 else value * tirx.const(float(scale), "float32")
        if total is None:
            total = term if coefficient > 0 else -term
        else:
            total = total + term if coefficient > 0 else total - term
    return total


def sandwich(left: list[list], values: list[list], right: list[list]) -> list[list]:
    """left . values . right^T as expressions: each row of `left`, then each of `right`."""
    columns = len(values[0])
    partial = [[combine(row, [values[i][j] for i in range(len(values))]) for j in range(columns)]
               for row in left]
    return [[combine(row, partial[a]) for row in right] for a in range(len(left))]


def select_by_index(index, expressions: list):
    """expressions[index]; a single expression once the loop over `index` is unrolled."""
    value = expressions[-1]
    for position in range(len(expressions) - 2, -1, -1):
        value = tirx.Select(index == position, expressions[position], value)
    return value


def tile_counts(out_h, out_w, tile: int):
    """Tile rows and columns of an output (simplified: the kernels' shapes must agree)."""
    analyzer = tvm.sym.Analyzer()
    return (analyzer.simplify((out_h + tile - 1) // tile),
            analyzer.simplify((out_w + tile - 1) // tile))


def tile_count(out_shape, tile: int):
    """The tiles of one image of an NCHW output: the GEMMs' row extent. (The images are a batch
    axis of the GEMM, not part of its rows: a row extent like n x 196, a multiple of the
    register tile's 7 rows, defeats TVM's region analysis in the register-tile schedule.)"""
    _, _, out_h, out_w = out_shape
    tiles_h, tiles_w = tile_counts(out_h, out_w, tile)
    return tvm.sym.Analyzer().simplify(tiles_h * tiles_w)


def winograd_weight(weight: te.Tensor, tile: int, panel_width: int) -> te.Tensor:
    """OIHW 3x3 -> [alpha^2, ceil(O / NB), I, NB]: G g G^T per output/input channel pair, output
    channels zero-padded to whole panels (the dense kernel's packed layout, one per point)."""
    out_channels, in_channels, _, _ = (int(d) for d in weight.shape)
    _, g_matrix, _ = MATRICES[tile]
    alpha = tile + 2
    panels = -(-out_channels // panel_width)
    def transformed(point, panel, c, lane):
        o = panel * panel_width + lane
        taps = [[weight[tirx.min(o, out_channels - 1), c, i, j] for j in range(3)]
                for i in range(3)]
        points = sandwich(g_matrix, taps, g_matrix)
        value = select_by_index(point, [value for values in points for value in values])
        return tirx.if_then_else(o < out_channels, value, tirx.const(0, weight.dtype))

    return te.compute((alpha * alpha, panels, in_channels, panel_width), transformed,
                      name="winograd_weight")


def winograd_input(data: te.Tensor, tile: int, padding) -> te.Tensor:
    """V[n, row, column, xi * alpha + nu, c] = (B^T d B)[xi, nu] for the input tile d at (row,
    column) of image n, in two passes (B^T d, then . B) that share their partial sums. The GEMM
    reads V with the tile row and column as one axis (a reshape: a view).

    The input is first copied channels-last and zero-padded to whole tiles, so each of the
    alpha x alpha reads of a tile is a contiguous vector of channels. The tile row and column
    are axes of their own: numbered as one axis, each tile's indices took a division and a
    remainder by the symbolic tile count, which TVM's schedule cannot split away (a split factor
    cannot be a symbolic dim)."""
    batch, channels, height, width = data.shape
    top, left, bottom, right = padding
    alpha = tile + 2
    b_transpose, _, _ = MATRICES[tile]
    tiles_h, tiles_w = tile_counts(height + top + bottom - 2, width + left + right - 2, tile)

    packed = pack_input_channels_last(data, padding, tiles_h * tile + 2, tiles_w * tile + 2,
                                      "winograd_input_nhwc")

    def rows_transformed(xi, j, n, row, column, c):  # (B^T d)[xi, j]
        column_in = [packed[n, row * tile + i, column * tile + j, c] for i in range(alpha)]
        return select_by_index(xi, [combine(b_row, column_in) for b_row in b_transpose])

    partial = te.compute((alpha, alpha, batch, tiles_h, tiles_w, channels), rows_transformed,
                         name="winograd_input_rows", attrs={STAGE_ANNOTATION: "transform_rows"})

    def transformed(n, row, column, point, c):  # (B^T d B)[xi, nu]
        row_values = [partial[point // alpha, j, n, row, column, c] for j in range(alpha)]
        return select_by_index(point % alpha, [combine(b_row, row_values) for b_row in b_transpose])

    return te.compute((batch, tiles_h, tiles_w, alpha * alpha, channels), transformed,
                      name="winograd_input_tiles",
                      attrs={KERNEL_ANNOTATION: WINOGRAD_INPUT, ROWS_ANNOTATION: 1,
                             TILE_ANNOTATION: tile})


def winograd_output(gemm: te.Tensor, out_shape, tile: int) -> te.Tensor:
    """Y[n, k, h, w] = (A^T M A) of the tile holding (h, w), from M[n, tile, point, k], in two
    passes (A^T M, then . A)."""
    batch, out_channels, out_h, out_w = out_shape
    alpha = tile + 2
    _, _, a_transpose = MATRICES[tile]
    tiles_h, tiles_w = tile_counts(out_h, out_w, tile)

    def columns_transformed(a, nu, n, t, k):  # (A^T M)[a, nu]
        column_values = [gemm[n, t, xi * alpha + nu, k] for xi in range(alpha)]
        return select_by_index(a, [combine(a_row, column_values) for a_row in a_transpose])

    partial = te.compute((tile, alpha, batch, tile_count(out_shape, tile), out_channels),
                         columns_transformed, name="winograd_output_rows",
                         attrs={STAGE_ANNOTATION: "transform_rows"})

    def tile_value(n, row, column, a, b, k):  # (A^T M A)[a, b]
        t = row * tiles_w + column
        row_values = [partial[a, nu, n, t, k] for nu in range(alpha)]
        return select_by_index(b, [combine(a_row, row_values) for a_row in a_transpose])

    tiles = te.compute((batch, tiles_h, tiles_w, tile, tile, out_channels), tile_value,
                       name="winograd_output_tiles",
                       attrs={KERNEL_ANNOTATION: WINOGRAD_OUTPUT, ROWS_ANNOTATION: 1,
                              TILE_ANNOTATION: tile})
    # The clamps are no-ops (h < out_h), but without them TVM cannot prove that the reads stay
    # inside the tiles (a symbolic out_h might be negative) and refuses to schedule the pair.
    return te.compute(
        (batch, out_channels, out_h, out_w),
        lambda n, k, h, w: tiles[n, tirx.min(h // tile, tiles_h - 1),
                                 tirx.min(w // tile, tiles_w - 1), h % tile, w % tile, k],
        name="winograd_out")


def schedule_input_transform(sch: s_tir.Schedule, tiles, isa: VectorISA, parallel: bool) -> None:
    """parallel for (image, tile row): for tile column, channel vector: for each column j of
    the tile, its alpha input vectors (a small stack array) and from them the alpha partial
    sums (B^T d)[xi, j]; then the alpha x alpha points (xi, nu) from the partial sums; all
    unrolled, vectorized over channels. The tile column stays out of the parallel loop, as in
    the output transform, so its index is a plain variable over a symbolic plane too.

    Each input vector is read from the packed input once per tile, not once per xi: every read
    indexes a 4-d buffer over the symbolic plane, and TVM's lowering (CSE, buffer flattening,
    simplification) took 2.4 s on the 216 reads of an F(4x4) kernel, 0.36 s on 36 (ResNet-18's
    7 input transforms: its build 32 -> 15 s). Alone, the kernel runs within 5% of the
    per-xi reads in three A/B rounds, either way (64 channels at 56x56: 52-59 vs 54-57 us; 24
    channels at 64x64: 108-113 vs 102-109 us); ResNet-18's runs are unchanged (1x3x128x128:
    3.59-3.74 vs 3.63-3.70 ms)."""
    n, row, column, point, c = sch.get_loops(tiles)
    alpha = _transform_rows_extent(sch, tiles)
    xi, nu = sch.split(point, [alpha, alpha])
    c_outer, c_lane = _split_lanes(sch, c, isa)
    sch.reorder(n, row, column, c_outer, xi, nu, *([c_lane] if c_lane is not None else []))
    partial = _transform_rows(sch, tiles)
    sch.compute_at(partial, c_outer)
    below_channels = _depth_under(sch, partial, c_outer)
    partial_xi, partial_j = sch.get_loops(partial)[below_channels:below_channels + 2]
    sch.reorder(partial_j, partial_xi)
    window = sch.cache_read(partial, 0, "local")
    sch.compute_at(window, partial_j)
    _unroll_from(sch, window, below_channels + 1, c_lane is not None)
    _unroll_from(sch, partial, below_channels, c_lane is not None)
    sch.unroll(xi)
    sch.unroll(nu)
    if c_lane is not None:
        sch.vectorize(c_lane)
    image_row = sch.fuse(n, row)
    if parallel:
        sch.parallel(image_row)


def schedule_output_transform(sch: s_tir.Schedule, tiles, out_block, tile: int, isa: VectorISA,
                              parallel: bool) -> None:
    """parallel for (image, tile row): for output-channel vector, tile column, output row a of
    the tile: the alpha partial sums A^T M of row a, its m outputs per channel, then the write
    to NCHW with the epilogue (stores strided by the image size).

    The tile column stays out of the parallel loop: fused into it, every tile's indices also
    took a division and a remainder by the symbolic tile count (fused // tiles_w,
    fused % tiles_w), which a static plane folds to constants; as a serial loop the column is a
    plain variable. Measured alone, 24 channels over a symbolic 64x64: 129 -> 92 us (static:
    36 us); static planes within noise (64 channels at 56x56: 41-43 -> 35-36 us).

    The channel vectors are at most OUTPUT_CHANNEL_LANES wide, and the tile columns run inside
    them: each store of a vector scatters its lanes over as many output planes, and where a
    plane is a multiple of 4 KB all of their rows fall into one set of the L1 cache. 16 planes
    overflowed the (12-way) set, and so did 8 planes per channel vector with every vector of a
    tile column written before the next column: each row of a plane was read again from L2 for
    every tile column that wrote into it. Measured alone, 64 channels, 2 threads, the output
    transform with 16 -> 8 lanes: 32x32 74.4 -> 14.7 us, 28x28 9.1 -> 8.9, 56x56 32.4 -> 33.9;
    whole convs (3 kernels), channel vectors inside -> outside the columns, both 8 lanes:
    F(2,3) 32 channels at 32x32 111.7 -> 39.6 us, 64 at 32x32 245 -> 98; F(4,3) 38.6 -> 35.4
    and 73.2 -> 68.0; within 3% at 56x56, 28x28 and 128 channels at 16x16."""
    n, k, h, w = sch.get_loops(out_block)
    row, a = sch.split(h, [None, tile])
    column, b = sch.split(w, [None, tile])
    k_outer, k_lane = _split_lanes(sch, k, isa, OUTPUT_CHANNEL_LANES)
    sch.reorder(n, row, k_outer, column, a, b, *([k_lane] if k_lane is not None else []))
    sch.compute_at(tiles, a)
    sch.compute_at(_transform_rows(sch, tiles), a)
    below_row = _depth_under(sch, tiles, a)
    for block in (tiles, _transform_rows(sch, tiles)):
        _unroll_from(sch, block, below_row, k_lane is not None)
    sch.unroll(b)
    if k_lane is not None:
        sch.vectorize(k_lane)
    fused = sch.fuse(n, row)
    if parallel:
        sch.parallel(fused)


def _transform_rows_extent(sch: s_tir.Schedule, tiles) -> int:
    return int(sch.get(_transform_rows(sch, tiles)).writes[0].source.shape[0])


def _transform_rows(sch: s_tir.Schedule, tiles):
    return next(block for block in sch.get_producers(tiles)
                if sch.get(block).name_hint.endswith("_rows"))


def _depth_under(sch: s_tir.Schedule, block, loop) -> int:
    """The depth of `block`'s loops under `loop` (one of its loops): where the loops a stage
    computed at `loop` begin."""
    target = sch.get(loop)
    return next(depth for depth, enclosing in enumerate(sch.get_loops(block), 1)
                if sch.get(enclosing).same_as(target))


def _unroll_from(sch: s_tir.Schedule, block, depth: int, vectorize: bool) -> None:
    """The loops of `block` from `depth` on unrolled; the innermost, the vector lanes,
    vectorized instead where `vectorize`."""
    loops = sch.get_loops(block)[depth:]
    if vectorize:
        *loops, lane = loops
        sch.vectorize(lane)
    for loop in loops:
        sch.unroll(loop)


def _split_lanes(sch: s_tir.Schedule, loop, isa: VectorISA, most_lanes: int | None = None):
    """(outer, vector lanes) when the loop is a whole number of vectors of the widest width
    (or `most_lanes`, if fewer), half of it or a quarter of it (at least 4 lanes), else (loop,
    None).

    Narrower vectors rather than scalar code: over a symbolic image the per-point strides are
    symbolic and LLVM does not vectorize the channel loop itself (it would have to check the 36
    store streams against each other), so 24 channels ran scalar. Two chained 24-channel
    Winograd convs over a symbolic 64x64 image: 1.14 -> 0.44 ms (static 0.38 -> 0.37 ms);
    12 channels at 32x32 0.098 -> 0.056 ms, 40 at 28x28 0.207 -> 0.138 ms."""
    extent = sch.get(loop).extent
    if not isinstance(extent, tirx.IntImm):
        return loop, None
    widest = min(isa.lanes, most_lanes or isa.lanes)
    for lanes in (widest, widest // 2, widest // 4):
        if lanes >= 4 and extent.value % lanes == 0:
            outer, lane = sch.split(loop, [None, lanes])
            return outer, lane
    return loop, None
