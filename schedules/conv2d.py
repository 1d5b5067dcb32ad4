"""Convolution kernels (NCHW in, NCHW out) as TE computes in the register-tile form.

Graph tensors stay NCHW (ONNX's layout; no graph-wide layout pass, which would have to see
through every op), and each kernel changes layout inside:
- `conv2d_direct`: the implicit GEMM (MNN's "sliding window" algorithm on NC4HW4 data, here
  with channels-last tiles). A packing stage writes the zero-padded input channels-last, so the
  micro-kernel broadcasts one input value and multiplies it by a vector of output channels of
  the packed weights [panel, KH, KW, C, NB] (packed offline by PreTransformWeights); rows of the
  tile are output pixels along the width. The write-back stores those rows to NCHW. A
  pointwise conv (1x1, stride 1, no padding) skips the packing: the broadcasts read the NCHW
  input directly, a tile's rows being consecutive floats of one channel row (the packing cost
  more than the multiply-adds of MobileNet's 64 -> 16 projection: 77 us of which most went to
  transposing the input).
- `conv2d_width_vectors`: tiles of output channels x a vector of output columns, so the
  accumulators are rows of the NCHW output and the write-back needs no transpose; it reads the
  input padded and split into row phases (`pack_input_phases`), or, pointwise, as it is, its
  columns then running along each image's whole flattened pixel plane. The cost model
  (conv_cost.py) prefers it to `conv2d_direct` wherever it measured faster.
- `im2col` + the pointwise `conv2d_width_vectors`: the input unfolded to C x KH x KW channels
  per output pixel, then a GEMM along the flattened pixels (explicit im2col + GEMM).
- `conv2d_depthwise`: one filter per channel has no reduction over channels to vectorize, so
  the vectors run along the output width in NCHW directly, over the same padded row phases.
The padded row phases are packed in vector loads and shuffles (padding.py).
Memory footprint (MNN pre-inference; recorded by passes/select_conv_algorithm.py): the packed
input (workspace) and the packed weights.
Grouped convs (ResNeXt's 3x3, ShuffleNet's 1x1) run as width vectors whose channel rows divide
each group's output channels, so a tile never straddles two groups and reads one group's input
channels. Limits: groups must be 1 for direct; fp32.
Threads: every kernel's parallel loop has the images outermost (the packing stages', the
tiles', Winograd's transforms', and the fallback schedule's fused leading loops), and TVM's
pool gives each thread one contiguous range of it, so at a batch of at least the thread count
an image stays on one core from kernel to kernel and each kernel reads what that core wrote.
Images inside the pixel tiles, as before, put each pointwise conv's output half on the other
core from the depthwise conv after it: in one process, MobileNetV2 at 2x3x160x128 3.57 ->
3.25 ms, mobilenet_v2_style at 2x3x96x80 0.33 -> 0.27 ms, resnet_style at 4x3x32x32 0.37 ->
0.30 ms, detector_fpn at 2x3x64x40 0.115 -> 0.105 ms; one image is unchanged.
"""

from __future__ import annotations

import tvm
from tvm import s_tir, te, tirx

from .isa import VectorISA
from .padding import PADDING_ANNOTATION
from .prefetch import PREFETCH_MIN_CHANNELS, PREFETCH_MIN_WEIGHT_BYTES
from .register_tile import (
    KERNEL_ANNOTATION,
    MAX_ROWS,
    OUTPUT_ROW_AXIS_ANNOTATION,
    PREFETCH_WEIGHT_ANNOTATION,
    REDUCTION_UNROLL_ANNOTATION,
    ROW_TILES,
    ROW_TILES_OUTER_MAX_WEIGHT_BYTES,
    ROWS_ANNOTATION,
    SINGLE_ROW,
    STAGE_ANNOTATION,
    VECTORS_ANNOTATION,
    WEIGHT_BYTES_ANNOTATION,
    TileKnobs,
    tile_cost,
    tile_operands,
    weight_bytes,
)

DIRECT = "conv2d_direct"
WIDTH_VECTORS = "conv2d_width_vectors"
DEPTHWISE = "conv2d_depthwise"
# Output channels of a width-vectors tile (its register rows), beside ROWS_ANNOTATION's
# columns per tile, which is the extent a version needs (dispatch.py).
CHANNEL_ROWS_ANNOTATION = "tightfit.channel_rows"
# On a tiles block whose row axis is the flattened H x W pixels of each image (pointwise convs).
FLAT_PIXELS_ANNOTATION = "tightfit.flat_pixels"
# A width-vectors conv's groups (its channel rows must divide a group's output channels).
GROUPS_ANNOTATION = "tightfit.groups"
# Output rows of a depthwise tile where the registers hold it (`depthwise_rows`):
# neighbouring rows share the loads of their common input rows, and each row is an
# independent chain of multiply-adds (a 3x3 tap sum is nine dependent FMAs). With symbolic
# widths the column-tile loop stays rolled, so the chains in one tile are all the core
# overlaps: 4 rows ran the zoo's layers 10-25% faster than 2 on AVX-512 (e.g. 2x64x48x40
# 33.9 -> 28.7 us, 576x14x14 18.6 -> 14.8 us), 8 rows were slower than 4.
DEPTHWISE_ROWS = 4
# On a depthwise tiles block: its output rows.
DEPTHWISE_ROWS_ANNOTATION = "tightfit.depthwise_rows"
# On a depthwise tiles block: (kernel_h, kernel_w, stride_h, stride_w, pad_top, pad_left,
# dilation_h, dilation_w), which direct_depthwise.py reads.
DEPTHWISE_WINDOW_ANNOTATION = "tightfit.depthwise_window"
# Padded input rows a thread packs at a time (_pack_in_row_blocks).
PACKED_ROW_BLOCK = 1
# The stage annotation of a channels-last packed input, and the channels it gathers at a time
# (gather_channels_in_blocks).
CHANNELS_LAST_STAGE = "channels_last_input"
PACKED_CHANNEL_BLOCK = 8
# A pointwise conv over many input channels runs in CHANNEL_VECTORS instead of ROW_TILES
# (`uses_channel_vectors`): its tiles hold CHANNEL_VECTOR_PIXELS pixels x one or two weight
# panels of CHANNEL_VECTORS_PANEL output channels, the vectors along the channels.
CHANNEL_VECTORS = "channel_vectors"
CHANNEL_VECTORS_ANNOTATION = "tightfit.channel_vectors"
CHANNEL_VECTORS_PANEL = 16
CHANNEL_VECTOR_PIXELS = 7
CHANNEL_VECTORS_MIN_CHANNELS = 256


def output_extent(size, pad_before: int, pad_after: int, kernel: int, stride: int, dilation: int):
    analyzer = tvm.sym.Analyzer()
    return analyzer.simplify((size + pad_before + pad_after - (kernel - 1) * dilation - 1) // stride + 1)


def pack_conv2d_weight(weight: te.Tensor, panel_width: int) -> te.Tensor:
    """OIHW -> [ceil(O / NB), KH, KW, I, NB], output channels zero-padded to whole panels."""
    out_channels, in_channels, kernel_h, kernel_w = (int(d) for d in weight.shape)
    panels = -(-out_channels // panel_width)

    def packed(panel, kh, kw, c, lane):
        o = panel * panel_width + lane
        return tirx.if_then_else(o < out_channels, weight[tirx.min(o, out_channels - 1), c, kh, kw],
                                 tirx.const(0, weight.dtype))

    return te.compute((panels, kernel_h, kernel_w, in_channels, panel_width), packed,
                      name="conv2d_weight_panels")


def im2col(data: te.Tensor, kernel: tuple[int, int], strides, padding, dilation) -> te.Tensor:
    """The input unfolded, [N, C x KH x KW, OH, OW]: channel k = (c, ry, rx) of pixel (oh, ow)
    is the padded input at (c, oh * sh + ry * dh, ow * sw + rx * dw). A 1x1 conv over it with
    the weight as [O, C x KH x KW] (`pack_im2col_weight`) is the conv: explicit im2col + GEMM,
    the GEMM being the pointwise width-vectors kernel along the whole flattened pixel plane."""
    batch, channels, height, width = data.shape
    (kernel_h, kernel_w), (stride_h, stride_w), (dil_h, dil_w) = kernel, strides, dilation
    top, left, bottom, right = padding
    out_h = output_extent(height, top, bottom, kernel_h, stride_h, dil_h)
    out_w = output_extent(width, left, right, kernel_w, stride_w, dil_w)
    padded = zero_padded(data, padding)
    taps = kernel_h * kernel_w

    def column(n, k, oh, ow):
        ry, rx = k % taps // kernel_w, k % kernel_w
        return padded(n, k // taps, oh * stride_h + ry * dil_h, ow * stride_w + rx * dil_w)

    return te.compute((batch, channels * taps, out_h, out_w), column, name="im2col")


def pack_im2col_weight(weight: te.Tensor, panel_width: int) -> te.Tensor:
    """OIHW -> the pointwise panels [ceil(O / NB), 1, 1, I x KH x KW, NB] of `im2col`'s GEMM."""
    out_channels, in_channels, kernel_h, kernel_w = (int(d) for d in weight.shape)
    taps = kernel_h * kernel_w
    rows = te.compute((out_channels, in_channels * taps, 1, 1),
                      lambda o, k, _h, _w: weight[o, k // taps, k % taps // kernel_w, k % kernel_w],
                      name="im2col_weight")
    return pack_conv2d_weight(rows, panel_width)


def conv2d_direct(data: te.Tensor, packed_weight: te.Tensor, out_channels: int, strides, padding,
                  dilation, rows: int, vectors: int, reduction_unroll: int = 1) -> te.Tensor:
    """NCHW conv as register tiles over (batch, out row, out col; out channel).

    `padding` is (top, left, bottom, right). The tiles' width domain is max(OW, rows) so that a
    tile of `rows` pixels always fits (tail_tiles.py); the version for OW < rows never reads it.
    """
    batch, channels, height, width = data.shape
    panels, kernel_h, kernel_w, _, panel_width = (int(d) for d in packed_weight.shape)
    (stride_h, stride_w), (dil_h, dil_w) = strides, dilation
    top, left, bottom, right = padding
    out_h = output_extent(height, top, bottom, kernel_h, stride_h, dil_h)
    out_w = output_extent(width, left, right, kernel_w, stride_w, dil_w)
    tile_w = tirx.max(out_w, rows)
    # Columns a full tile may read: the last shifted tile ends inside the padded image whenever
    # out_w >= rows; the extra right padding only covers the never-run narrow case.
    packed_w = (tile_w - 1) * stride_w + (kernel_w - 1) * dil_w + 1
    packed_h = height + top + bottom

    if is_pointwise(kernel_h, kernel_w, strides, padding):
        def input_pixel(n, h, w, c):
            return data[n, c, h, w]
    else:
        packed_input = pack_input_channels_last(data, padding, packed_h, packed_w,
                                                "conv2d_input_nhwc")

        def input_pixel(n, h, w, c):
            return packed_input[n, h, w, c]

    ry = te.reduce_axis((0, kernel_h), "ry")
    rx = te.reduce_axis((0, kernel_w), "rx")
    rc = te.reduce_axis((0, channels), "rc")

    def tile_value(n, oh, ow, o):
        pixel = input_pixel(n, oh * stride_h + ry * dil_h, ow * stride_w + rx * dil_w, rc)
        return te.sum(pixel * packed_weight[o // panel_width, ry, rx, rc, o % panel_width],
                      axis=[ry, rx, rc])

    tiles = te.compute((batch, out_h, tile_w, panels * panel_width), tile_value,
                       name="conv2d_tiles",
                       attrs={KERNEL_ANNOTATION: DIRECT, ROWS_ANNOTATION: rows,
                              VECTORS_ANNOTATION: vectors, OUTPUT_ROW_AXIS_ANNOTATION: 3,
                              REDUCTION_UNROLL_ANNOTATION: reduction_unroll,
                              **_one_tile_row_weight_bytes(out_w, rows, packed_weight),
                              **_prefetched_weight(packed_weight)})
    return te.compute((batch, out_channels, out_h, out_w), lambda n, o, h, w: tiles[n, h, w, o],
                      name="conv2d_out")


def _one_tile_row_weight_bytes(out_w, rows: int, packed_weight: te.Tensor) -> dict:
    """WEIGHT_BYTES_ANNOTATION for a direct conv whose output rows are one tile (a known width
    of `rows` or less), so that a large weight runs its panels outermost (register_tile.py):
    row tiles outermost read the whole weight once per output row, 4.7 MB for ResNet's 256 ->
    512 stride-2 conv at 4x4 (846 -> 354-459 us alone with the panels outermost). Not on wider
    rows: there row tiles outermost keep each tile's input in cache across the panels, and
    measured faster (64 -> 128 stride 2 at 24x28, 650 against 800 us; 128 -> 256 at 28x28,
    1960-2080 against 2180-2400 us). The short tiles of a symbolic width run their panels
    outermost regardless (register_tile.SHORT_ROW_TILES)."""
    if isinstance(out_w, (int, tirx.IntImm)) and int(out_w) <= rows:
        return {WEIGHT_BYTES_ANNOTATION: weight_bytes(packed_weight, 5)}
    return {}


def _prefetched_weight(packed_weight: te.Tensor) -> dict:
    """PREFETCH_WEIGHT_ANNOTATION for a direct conv whose packed weight is
    PREFETCH_MIN_WEIGHT_BYTES or more (prefetch.py)."""
    if weight_bytes(packed_weight, 5) >= PREFETCH_MIN_WEIGHT_BYTES:
        return {PREFETCH_WEIGHT_ANNOTATION: 1}
    return {}


def is_pointwise(kernel_h: int, kernel_w: int, strides, padding) -> bool:
    """A 1x1 conv with stride 1 and no padding: a GEMM over the NCHW input as it is."""
    return (kernel_h, kernel_w) == (1, 1) and tuple(strides) == (1, 1) and not any(padding)


def conv2d_width_vectors(data: te.Tensor, packed_weight: te.Tensor, out_channels: int, strides,
                         padding, dilation, vectors: int, lanes: int, groups: int = 1,
                         channel_vectors: bool = False) -> te.Tensor:
    """NCHW conv as register tiles over (output channels; output columns), NCHW throughout.

    A tile holds `channel_rows` output channels (the weight panel width) x `vectors` vectors of
    consecutive output columns of one output row: per reduction step it broadcasts
    `channel_rows` weights and loads `vectors` input vectors. The accumulators are rows of the
    NCHW output, so the write-back is plain vector stores (no transpose, unlike conv2d_direct),
    and a 1x1 stride-1 conv reads its input as it is; any other conv reads the padded, phased
    input of `pack_input_phases`. Tiles along the width are shifted back at the end
    (tail_tiles.py), so the width domain is max(OW, vectors x lanes).

    A pointwise conv is a GEMM over each image's whole pixel plane, which is contiguous in NCHW:
    its tiles run along the flattened pixels (H x W columns, FLAT_PIXELS_ANNOTATION), so a 7x7
    map fills three vectors and a shifted tail instead of seven lanes of one vector per row
    (MobileNetV2's 1x1 convs at 14x14 and 7x7 ran at 12% of peak per row). The write-back's
    (h, w) are fused to that axis when it is scheduled (`flatten_output_pixels`).

    With `groups` > 1 the channel rows must divide each group's output channels
    (`width_tile_knobs`): a tile's panel then lies in one group, whose input channels its
    reduction runs over (the packed weight's input axis holds one group's channels).
    `channel_vectors` marks a pointwise conv for the CHANNEL_VECTORS version
    (`uses_channel_vectors`; its panels must be whole vectors).
    """
    batch, _, height, width = data.shape
    panels, kernel_h, kernel_w, group_channels, channel_rows = (int(d) for d in packed_weight.shape)
    if groups > 1 and (out_channels // groups) % channel_rows:
        raise ValueError(f"{channel_rows} channel rows do not divide a group's "
                         f"{out_channels // groups} output channels")
    panels_per_group = panels // groups
    tile_columns = vectors * lanes
    attrs = {KERNEL_ANNOTATION: WIDTH_VECTORS, ROWS_ANNOTATION: tile_columns,
             VECTORS_ANNOTATION: vectors, CHANNEL_ROWS_ANNOTATION: channel_rows,
             GROUPS_ANNOTATION: groups, WEIGHT_BYTES_ANNOTATION: weight_bytes(packed_weight, 5)}
    rc = te.reduce_axis((0, group_channels), "rc")

    def input_channel(o):
        # the panel, not o: o // channel_rows is the tile's outer channel loop once split
        return rc if groups == 1 else (o // channel_rows) // panels_per_group * group_channels + rc

    if is_pointwise(kernel_h, kernel_w, strides, padding):
        def pixel_value(n, o, p):
            weight = packed_weight[o // channel_rows, 0, 0, rc, o % channel_rows]
            return te.sum(data[n, input_channel(o), p // width, p % width] * weight, axis=rc)

        tiles = te.compute((batch, panels * channel_rows, _pixel_domain(height, width, tile_columns)),
                           pixel_value, name="conv2d_width_tiles",
                           attrs={**attrs, OUTPUT_ROW_AXIS_ANNOTATION: 2,
                                  FLAT_PIXELS_ANNOTATION: True,
                                  CHANNEL_VECTORS_ANNOTATION: channel_vectors})
        return te.compute((batch, out_channels, height, width),
                          lambda n, o, h, w: tiles[n, o, h * width + w], name="conv2d_width_out")

    (stride_h, stride_w), (dil_h, dil_w) = strides, dilation
    top, left, bottom, right = padding
    out_h = output_extent(height, top, bottom, kernel_h, stride_h, dil_h)
    out_w = output_extent(width, left, right, kernel_w, stride_w, dil_w)
    tile_w = tirx.max(out_w, tile_columns)
    ry = te.reduce_axis((0, kernel_h), "ry")
    rx = te.reduce_axis((0, kernel_w), "rx")
    packed_input = pack_input_phases(data, tile_w, kernel_w, strides, padding, dilation,
                                     "conv2d_input_phases")

    def tile_value(n, o, oh, ow):
        tap = rx * dil_w
        pixel = packed_input[n, input_channel(o), oh * stride_h + ry * dil_h, tap % stride_w,
                             ow + tap // stride_w]
        weight = packed_weight[o // channel_rows, ry, rx, rc, o % channel_rows]
        return te.sum(pixel * weight, axis=[ry, rx, rc])

    tiles = te.compute((batch, panels * channel_rows, out_h, tile_w), tile_value,
                       name="conv2d_width_tiles", attrs={**attrs, OUTPUT_ROW_AXIS_ANNOTATION: 3})
    return te.compute((batch, out_channels, out_h, out_w),
                      lambda n, o, h, w: tiles[n, o, h, w], name="conv2d_width_out")


def _pixel_domain(height, width, tile_columns: int):
    """The flat tiles' pixel domain: at least the pixel plane and one tile (tail_tiles.py).
    With a static height it is written height x max(width, tile / height), a multiple of the
    height: as max(height x width, tile), TVM could not prove the write-back's region covered
    for heights that do not divide the tile (6, 12, 48 at 32 columns) and scheduling failed.
    The two differ only where the plane is narrower than a tile (the single-row version, which
    restricts its loop to the plane)."""
    if isinstance(height, tirx.IntImm):
        return height * tirx.max(width, -(-tile_columns // int(height)))
    return tirx.max(height * width, tile_columns)


def tile_kind(flat_pixels: bool) -> str:
    """The knob database's kind for a width-vectors conv's tiles: row tiles and flat-pixel
    tiles (pointwise convs, im2col's GEMM) default to different tiles (`width_tile_knobs`)."""
    return f"{WIDTH_VECTORS}_flat" if flat_pixels else WIDTH_VECTORS


def output_row_extent(out_shape, annotations) -> tuple[object, int]:
    """(row extent, row axis) of a kernel's out block as scheduled: the annotated axis, or for
    flat-pixel tiles the out block's pixel plane (H x W) fused at axis 2."""
    if FLAT_PIXELS_ANNOTATION in annotations:
        return out_shape[2] * out_shape[3], 2
    axis = int(annotations[OUTPUT_ROW_AXIS_ANNOTATION])
    return out_shape[axis], axis


def flatten_output_pixels(sch: s_tir.Schedule, out_block) -> None:
    """Fuse the (h, w) axes of an NCHW out block into one pixel axis h x W + w, the axis of
    flat-pixel tiles (the block must still be its own loop nest: right after the epilogue is
    inlined)."""
    width = sch.get(out_block).iter_vars[3].dom.extent
    sch.transform_block_layout(out_block, tirx.IndexMap.from_func(
        lambda n, o, h, w: (n, o, h * width + w), index_dtype=width.ty.dtype))


def width_tile_knobs(isa: VectorISA, out_channels: int,
                     pointwise_weight_bytes: int | None = None, groups: int = 1,
                     vectors: int | None = None) -> TileKnobs:
    """Channel rows x vectors of columns for a conv2d_width_vectors tile (`vectors` given: the
    channel rows for that many).

    One vector along an output row where a multiply-add reads its broadcast weight from memory
    (isa.fma_reads_broadcast: AVX-512, NEON): the shifted tail of two-vector tiles recomputes up
    to a vector per row (a 40-wide output in 32-column tiles computes 64 columns), and widths of
    one vector up run the tiled version. Measured on the zoo's layers (AVX-512, 2 threads), one
    vector beat two by 1.2-1.5x. Two vectors on AVX2, where each channel row's weight costs a
    broadcast load of its own (an 8 x 1 tile issues 9 loads for 8 FMAs, a 4 x 2 tile 6): on an
    AMD AVX2 host, 2 threads, resnet_style's 16 -> 16 3x3 convs at 4 x 32 x 32 took 290 and
    298 us in 8 x 1 tiles, 209 and 215 us in 4 x 2; whole runs in one process, resnet_style at
    4x3x32x32 990 -> 736 us, conv_dynamic_hw at 1x3x32x32 45 -> 28 us, at 45 x 61 70 -> 52 us,
    at 64 x 20 69 -> 58 us, mobilenet_v2_style at 2x3x96x80 1157 -> 1078 us (its 3x3 convs are
    the stem and depthwise ones; 64 x 64 unchanged). A pointwise conv's tiles run along the
    whole flattened pixel plane, where two vectors add no tail per row and halve the
    broadcasts per multiply-add (a 6 x 2 tile broadcasts 6 weights and loads 2 input vectors
    for 12 FMAs; 13 x 1, 13 and 1 for 13): mobilenet_v2_style's 16 -> 64 layers at 2 x 48 x 40
    went from 24.8 to 19.4 us, its 64 -> 16 layers from 29 to 26 us, MobileNetV2's 16 -> 96 at
    112 x 112 from 153 to 103 us.
    Not where the weights (`pointwise_weight_bytes`) exceed ROW_TILES_OUTER_MAX_WEIGHT_BYTES:
    those layers come late in a network, on maps of a few hundred pixels or less, where fewer
    channel rows cost more than the broadcasts save (a map under two vectors runs pixel by
    pixel with the channel rows as the vector). The channel rows are the count, among those
    whose tile fits the registers (isa.fits_registers), with the least `tile_cost` over all
    output channels, padding included: 16 channels in two 8-row tiles rather than 15 + 1.
    With `groups` > 1 only counts dividing a group's output channels qualify (a ResNeXt group
    of 4 channels gets 4-row tiles).
    """
    if vectors is None and pointwise_weight_bytes is not None:
        vectors = 2 if pointwise_weight_bytes <= ROW_TILES_OUTER_MAX_WEIGHT_BYTES else 1
    elif vectors is None:
        vectors = 1 if isa.fma_reads_broadcast else 2
    fitting = [r for r in range(1, MAX_ROWS + 1) if isa.fits_registers(r, vectors)
               and (groups == 1 or (out_channels // groups) % r == 0)]
    channel_rows = min(fitting, key=lambda r: (-(-out_channels // r) * tile_cost(r, vectors), -r))
    return TileKnobs(rows=channel_rows, vectors=vectors)


def uses_channel_vectors(isa: VectorISA, in_channels: int, out_channels: int,
                         groups: int, weight_bytes: int) -> bool:
    """Whether a pointwise conv runs in CHANNEL_VECTORS (weight panels of
    CHANNEL_VECTORS_PANEL channels) rather than ROW_TILES.

    ROW_TILES lays vectors along the pixels, and a plane that is not a whole number of vectors
    wastes lanes: a 7x7 map computes 64 columns for 49, a 5x4 map 32 for 20 (MobileNetV2's
    last stage). CHANNEL_VECTORS lays them along the output channels and tiles the pixels by
    CHANNEL_VECTOR_PIXELS, wasting none there; but its write-back stores each output alone (an
    output channel's pixels are a plane apart in NCHW), which a short reduction does not pay
    for. Its time as a share of ROW_TILES' (the kernel before it, prefetching alike), in one
    process, two threads:
    - 320 -> 1280 at 1x7x7 / 2x5x4 / 1x14x14: 0.71 / 0.64 / 0.92; 960 -> 320: 0.72 / 0.61 /
      0.86; 960 -> 160 and 576 -> 160 at 1x7x7 / 2x5x4: 0.62-0.78; 576 -> 96 at 1x14x14 /
      2x10x8 / 1x7x7: 0.88 / 1.00 / 0.76; 384 -> 96 at 1x14x14 / 2x10x8: 0.91 / 1.05;
    - with fewer input channels the write-back tells: 160 -> 960 at 1x7x7 / 2x5x4 / 1x14x14 /
      2x10x8: 0.81 / 0.70 / 0.94 / 1.16; 96 -> 576 at 1x14x14 / 2x10x8: 0.95 / 1.21.
    Hence from CHANNEL_VECTORS_MIN_CHANNELS input channels, at every plane size.
    Also from fewer where a multiply-add cannot read its broadcast from memory (AVX2: not
    isa.fma_reads_broadcast) and ROW_TILES would get one-vector tiles (`weight_bytes` over
    ROW_TILES_OUTER_MAX_WEIGHT_BYTES, `width_tile_knobs`): a 14 x 1 tile loads 14 broadcasts
    and a vector for 14 FMAs, CHANNEL_VECTORS' 6 pixels x 2 vectors 6 and 2 for 12. On an AMD
    AVX2 host, 2 threads, MobileNetV2's 96 -> 576 at 1x14x14 / 2x10x8 took 288 / 190 us in
    ROW_TILES and 157 / 125 us in CHANNEL_VECTORS; 160 -> 960 at 1x7x7 / 2x5x4 181 / 155 and
    119 / 100 us. Where ROW_TILES gets two vectors it stays (144 -> 32 and 192 -> 32 at 28 x 28
    were 8-10% slower in CHANNEL_VECTORS, 192 -> 64 at 14 x 14 alike). Whole MobileNetV2 runs
    in one process, min of 9 rounds: 7.34 -> 6.91 ms at 1x3x224x224, 6.90 -> 6.37 ms at
    2x3x160x128.
    The output channels must fill the panels (a tile writes whole panels)."""
    one_vector_row_tiles = (not isa.fma_reads_broadcast
                            and width_tile_knobs(isa, out_channels, weight_bytes).vectors == 1)
    return (groups == 1
            and (in_channels >= CHANNEL_VECTORS_MIN_CHANNELS or one_vector_row_tiles)
            and out_channels % CHANNEL_VECTORS_PANEL == 0
            and CHANNEL_VECTORS_PANEL % isa.lanes == 0)


def channel_vector_tile(isa: VectorISA, channels: int) -> tuple[int, int]:
    """(weight panels, pixels) of a CHANNEL_VECTORS tile over `channels` (padded) output
    channels: two panels where they pair up and CHANNEL_VECTOR_PIXELS pixels still fit the
    registers beside them (AVX-512: 2 x 7), else one panel and as many pixels as fit (NEON's
    four vectors a panel: 1 x 6).
    Not a pixel fewer where that wastes fewer (AVX2's 6-pixel tiles compute 54 pixels for a
    7x7 plane, 5-pixel ones 50; 24 and 20 for 5x4): measured on an AMD AVX2 host, 320 -> 1280
    alone, one thread, 5 pixels took 0.95x the time at 1x7x7 and 0.90x at 2x5x4, but whole
    MobileNetV2 runs (bench/ab_revisions.py, 12 turns, 5 pixels everywhere) went 1.01x at
    1x3x224x224 (its 14x14 layers lose) and 0.97x at 2x3x160x128, which a version picking
    per plane would not repay in compile time (one more version of each of these convs over a
    symbolic plane)."""
    for panels in (2, 1):
        vectors = panels * CHANNEL_VECTORS_PANEL // isa.lanes
        pixels = max((rows for rows in range(1, CHANNEL_VECTOR_PIXELS + 1)
                      if isa.fits_registers(rows, vectors)), default=0)
        if channels % (panels * CHANNEL_VECTORS_PANEL) == 0 and (
                pixels == CHANNEL_VECTOR_PIXELS or panels == 1):
            return panels, pixels
    raise ValueError(f"{channels} channels are not whole {CHANNEL_VECTORS_PANEL}-channel panels")


def channel_vector_buckets(pixels, tile_pixels: int) -> list[tuple[str, object]]:
    """dispatch.row_buckets for a CHANNEL_VECTORS conv: whole tiles of `tile_pixels` pixels
    from a tile's worth up, one pixel at a time below (SINGLE_ROW)."""
    if isinstance(pixels, (int, tirx.IntImm)):
        return [(CHANNEL_VECTORS if int(pixels) >= tile_pixels else SINGLE_ROW, None)]
    return [(CHANNEL_VECTORS, pixels >= tile_pixels), (SINGLE_ROW, None)]


def schedule_width_vectors(sch: s_tir.Schedule, tiles, out_block, row_extent, out_row_axis: int,
                           channel_rows: int, vectors: int, isa: VectorISA, version: str,
                           parallel: bool = True) -> list[tuple]:
    """The conv2d_width_vectors micro-kernel:

        parallel for (batch, output row, channel panel):   # the panel count is static
          for column tile:                                 # vectors x lanes columns
            acc[channel_rows][vectors] = 0
            for ry, rx, c: acc[i][v] += W[panel, ry, rx, c, i] * input[c, row + ry, col + v + rx]
            output[panel rows, row, tile columns] = epilogue(acc)

    Flat-pixel tiles (pointwise convs) have no output row: the parallel loop is (batch, pixel
    tile, channel panel), or (batch, channel panel, pixel tile) for weights over
    ROW_TILES_OUTER_MAX_WEIGHT_BYTES, and `out_block` must have been through
    `flatten_output_pixels`. The batch is outermost everywhere (module docstring).

    Narrower outputs (the SINGLE_ROW version): a conv that reads the padded input computes one
    full tile per row from column 0 (the padded input is a tile wide, so the extra columns read
    zeros) and writes only the output's columns, through a bounds check per column; a pointwise
    conv over fewer pixels than a vector, which reads the input as it is and so must not read
    past the image, runs one pixel at a time with the channel rows as a vector (the weight
    panel is contiguous along them).

    The CHANNEL_VECTORS version (`uses_channel_vectors`) is `_schedule_channel_vectors`.
    """
    flat = FLAT_PIXELS_ANNOTATION in sch.get(tiles).annotations
    if version == CHANNEL_VECTORS:
        return _schedule_channel_vectors(sch, tiles, out_block, row_extent, out_row_axis,
                                         channel_rows, isa, parallel)
    tile_row_axis = 2 if flat else 3
    n, o, *image_rows, ow = sch.get_loops(tiles)[:tile_row_axis + 1]
    reductions = sch.get_loops(tiles)[tile_row_axis + 1:]
    o_outer, o_inner = sch.split(o, [None, channel_rows])
    pack_rows = [("pack_rows", sch.get(block).name_hint, isa.lanes,
                  *_version_condition(version, row_extent, vectors * isa.lanes))
                 for block in _packing_stages(sch, tiles)]
    reads_padded_input = bool(pack_rows)
    if parallel:
        for block in _packing_stages(sch, tiles):
            _pack_in_row_blocks(sch, block)
    if version == ROW_TILES or reads_padded_input:
        ow_outer, ow_vector, ow_lane = sch.split(ow, [None, vectors, isa.lanes])
        weight_over_l2 = (int(sch.get(tiles).annotations[WEIGHT_BYTES_ANNOTATION])
                          > ROW_TILES_OUTER_MAX_WEIGHT_BYTES)
        if flat and weight_over_l2:
            sch.reorder(n, o_outer, ow_outer, *reductions, o_inner, ow_vector, ow_lane)
            sch.reverse_compute_at(out_block, ow_outer)
            _fuse_outer_loops(sch, [n, o_outer, ow_outer], parallel)
        elif flat:
            # the pixel tiles give the parallelism where the channel panels are few
            sch.reorder(n, ow_outer, o_outer, *reductions, o_inner, ow_vector, ow_lane)
            sch.reverse_compute_at(out_block, o_outer)
            _fuse_outer_loops(sch, [n, ow_outer, o_outer], parallel)
        else:
            sch.reorder(n, *image_rows, o_outer, ow_outer, *reductions, o_inner, ow_vector, ow_lane)
            sch.reverse_compute_at(out_block, ow_outer)
            _fuse_outer_loops(sch, [n, *image_rows, o_outer], parallel)
        sch.unroll(o_inner)
        sch.unroll(ow_vector)
        sch.vectorize(ow_lane)
        init = sch.decompose_reduction(tiles, reductions[0])
        out_name = sch.get(out_block).name_hint
        row_iters = {sch.get(tiles).name_hint: tile_row_axis,
                     sch.get(init).name_hint: tile_row_axis, out_name: out_row_axis}
        *_, write_channels, write_columns = sch.get_loops(out_block)
        if version == ROW_TILES:
            _, write_lane = sch.split(write_columns, [None, isa.lanes])
            sch.vectorize(write_lane)
        else:
            sch.unroll(write_channels)
            sch.vectorize(write_columns)
        prefetch = (_prefetch_operands(sch, tiles, reductions[0])
                    if flat and not reads_padded_input else [])
        return (_column_tile_rewrites(sch, version, row_iters, vectors * isa.lanes, row_extent,
                                      out_name, ow_outer) + pack_rows + prefetch)
    sch.reorder(n, *image_rows, o_outer, ow, *reductions, o_inner)
    sch.reverse_compute_at(out_block, ow)
    _fuse_outer_loops(sch, [n, *image_rows, o_outer], parallel)
    if channel_rows % isa.lanes == 0:  # whole vectors (a CHANNEL_VECTORS conv's panel)
        o_vector, o_inner = sch.split(o_inner, [None, isa.lanes])
        sch.unroll(o_vector)
    sch.vectorize(o_inner)
    sch.decompose_reduction(tiles, reductions[0])
    return [("restrict", sch.get(ow).loop_var, row_extent)]


def _pack_in_row_blocks(sch: s_tir.Schedule, packing) -> None:
    """Share a packing stage's padded rows among the threads in blocks of PACKED_ROW_BLOCK
    rows, images outermost (module docstring) and every channel of a row inside: the tiles
    share them by (image, output row) too, so each thread then reads (nine times, for a 3x3
    conv) mostly rows it packed itself. Split by images and channels, as before, half of a
    tile's input came from the other core's cache at one image. Measured in one process
    against that split: resnet_style's 16 -> 16 3x3 convs at 32x32 32 -> 21 us alone, its
    whole run at batch 1 0.125 -> 0.113 ms; MobileNetV2's first conv at 2x3x160x128 216 ->
    169 us in a run. Split by rows across images instead, the stage after detector_fpn's
    concatenation (which splits by images) read half its input from the other core: at batch
    2, 0.105 ms for the whole run became 0.117 ms; images outermost, it is 0.105 ms again.
    Blocks of 1 row balanced best (of 1, 2 and 4: resnet_style at batch 4, 0.372 / 0.379 /
    0.400 ms, measured while the images were still inside the row blocks)."""
    n, c, row, *_ = sch.get_loops(packing)
    # split, not just moved out: padding.vector_packing_rows needs a row loop right above
    # the phase and column loops
    row_block, row_in_block = sch.split(row, [None, PACKED_ROW_BLOCK])
    sch.reorder(n, row_block, c, row_in_block)
    sch.parallel(sch.fuse(n, row_block))


def _schedule_channel_vectors(sch: s_tir.Schedule, tiles, out_block, row_extent,
                              out_row_axis: int, panel_width: int, isa: VectorISA,
                              parallel: bool) -> list[tuple]:
    """The CHANNEL_VECTORS micro-kernel (`uses_channel_vectors`):

        parallel for (batch, channel tile, pixel tile):   # channel_vector_tile
          acc[pixels][channel vectors] = 0
          for c: acc[j][v] += input[c, pixel j] * W[panel of v, c, lanes]
          output[tile channels, tile pixels] = epilogue(acc)  # each value a plane apart

    The pixel tiles are shifted back at the end of the plane (tail_tiles.py), so the plane
    must hold a tile (channel_vector_buckets). Two panels per tile (14 accumulators) ran
    MobileNetV2's 7x7 layers 10-20% faster than one (7, too few to hide the multiply-add
    latency); all three loops share the threads, as a 96-channel layer has three tiles.
    """
    panels, pixels = channel_vector_tile(isa, int(sch.get(tiles).iter_vars[1].dom.extent))
    # each accumulator is a vector of channels: they must be contiguous in the tile buffer
    sch.transform_layout(tiles, ("write", 0), lambda n, o, p: (n, p, o))
    n, o, pixel, *reductions = sch.get_loops(tiles)
    o_outer, o_vector, o_lane = sch.split(o, [None, panels * panel_width // isa.lanes,
                                              isa.lanes])
    pixel_outer, pixel_row = sch.split(pixel, [None, pixels])
    sch.reorder(n, o_outer, pixel_outer, *reductions, pixel_row, o_vector, o_lane)
    sch.reverse_compute_at(out_block, pixel_outer)
    _fuse_outer_loops(sch, [n, o_outer, pixel_outer], parallel)
    sch.unroll(pixel_row)
    sch.unroll(o_vector)
    sch.vectorize(o_lane)
    init = sch.decompose_reduction(tiles, reductions[0])
    write_channels, write_pixels = sch.get_loops(out_block)[-2:]
    sch.reorder(write_pixels, write_channels)
    sch.vectorize(sch.split(write_channels, [None, isa.lanes])[1])
    row_iters = {sch.get(tiles).name_hint: 2, sch.get(init).name_hint: 2,
                 sch.get(out_block).name_hint: out_row_axis}
    return ([("shift", row_iters, pixels, row_extent)]
            + _prefetch_operands(sch, tiles, reductions[0]))


def _prefetch_operands(sch: s_tir.Schedule, tiles, channel_loop) -> list[tuple]:
    """The prefetch rewrites (prefetch.py) of a pointwise conv's operands: its input, read as
    it is, where the reduction over its channels is long enough to pay for it, and its packed
    weights where they are too large to stay in L2 from one run to the next."""
    block = sch.get(tiles)
    data, weights = tile_operands(block)
    channels = sch.get(channel_loop).extent
    channel_var = sch.get(channel_loop).loop_var
    rewrites = []
    if isinstance(channels, tirx.IntImm) and channels.value >= PREFETCH_MIN_CHANNELS:
        rewrites.append(("prefetch", block.name_hint, channel_var, data))
    if int(block.annotations[WEIGHT_BYTES_ANNOTATION]) >= PREFETCH_MIN_WEIGHT_BYTES:
        rewrites.append(("prefetch", block.name_hint, channel_var, weights))
    return rewrites


def pack_input_phases(data: te.Tensor, tile_w, kernel_w: int, strides, padding, dilation,
                      name: str, rows=None) -> te.Tensor:
    """Zero-padded NCHW input with each padded row split into `stride_w` phases:
    [N, C, padded H, stride_w, phase_w]; phase p, column j is padded column j * stride_w + p,
    so output column ow, tap kw reads phase (kw * dil_w) % stride_w at column
    ow + (kw * dil_w) // stride_w, consecutive in ow for any stride. `tile_w` is the width
    domain the tiles cover (at least the output width); `rows`, when given, the padded rows
    to hold (more than the padded input's, the rest zeros). padding.vector_packing_rows
    rewrites its loops once scheduled."""
    batch, channels, height, width = data.shape
    stride_w, dil_w = strides[1], dilation[1]
    top, left, bottom, _ = padding
    phase_w = tile_w + ((kernel_w - 1) * dil_w) // stride_w
    rows = height + top + bottom if rows is None else tirx.max(height + top + bottom, rows)

    padded = zero_padded(data, padding)
    return te.compute((batch, channels, rows, stride_w, phase_w),
                      lambda n, c, h, phase, j: padded(n, c, h, j * stride_w + phase),
                      name=name, attrs={STAGE_ANNOTATION: "packed_input",
                                        PADDING_ANNOTATION: [top, left, stride_w]})


def pack_input_channels_last(data: te.Tensor, padding, packed_h, packed_w, name: str) -> te.Tensor:
    """The zero-padded input channels-last, [N, packed_h, packed_w, C] (at least the padded
    image; the rest zeros), so a vector of channels is one contiguous load. Scheduled by
    `gather_channels_in_blocks`."""
    batch, channels, _, _ = data.shape
    padded = zero_padded(data, padding)
    return te.compute((batch, packed_h, packed_w, channels),
                      lambda n, h, w, c: padded(n, c, h, w),
                      name=name, attrs={STAGE_ANNOTATION: CHANNELS_LAST_STAGE})


def gather_channels_in_blocks(sch: s_tir.Schedule) -> None:
    """Each channels-last packing stage at the function's root (`pack_input_channels_last`)
    packs a row PACKED_CHANNEL_BLOCK channels at a time: for each block, every column's
    channels of the block, so the block's input rows stay in the L1 cache while their columns
    are gathered.

    All channels per column, as TE wrote it, each column gathered one value from every channel
    plane; where a plane is a multiple of 4 KB (32x32, 64x64) the planes' rows all fall into
    one set of the (12-way) L1 cache, each gather evicted the rows the next column needed, and
    every input line was read again from L2 for each of its 16 columns. Blocks of 8 fit the
    set. Measured alone, 2 threads, 64 channels: Winograd's input transform at 32x32 57.7 ->
    12.7 us, at 28x28 11.7 -> 10.0, at 56x56 59 -> 37 us (blocks of 4: 12.3 / 11.8 / 44; of
    16: 15.2 / 10.3 / 38.8; vectorized gathers of 8 or 16 slower: 14.8-16.3 us at 32x32)."""
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        if sch.get(block).annotations.get(STAGE_ANNOTATION) != CHANNELS_LAST_STAGE:
            continue
        n, h, w, c = sch.get_loops(block)
        channel_block, channel = sch.split(c, [None, PACKED_CHANNEL_BLOCK])
        sch.reorder(channel_block, w, channel)


def zero_padded(data: te.Tensor, padding):
    """(n, c, h, w) -> the input at padded row h, column w: data inside, 0 in the padding
    (`padding` is (top, left, bottom, right)) and beyond."""
    _, _, height, width = data.shape
    top, left = padding[0], padding[1]

    def value(n, c, h, w):
        inside = tirx.all(h >= top, h < height + top, w >= left, w < width + left)
        return tirx.if_then_else(inside, data[n, c, h - top, w - left], tirx.const(0, data.dtype))

    return value


def depthwise_rows(isa: VectorISA, kernel_h: int, kernel_w: int) -> int:
    """Output rows of a depthwise tile: DEPTHWISE_ROWS where the registers hold the tile with
    the input rows it shares (at stride 1: rows + kernel_h - 1 rows of kernel_w vectors) beside
    its accumulators and the channel's filter taps, which stay in registers across the
    channel's tiles (`_copy_filter_per_channel`); else one row, whose inputs the multiply-adds
    read straight from memory. A 3x3 tile of 4 rows needs 9 + 4 + 18 = 31 registers: AVX-512's
    and NEON's 32 hold it, AVX2's 16 do not, and there LLVM spilled taps and inputs to the
    stack around every tile. On an AMD AVX2 host, 2 threads, one process, MobileNetV2's
    depthwise layers (bias and ReLU6 fused) took, in one-row vs four-row tiles: 32 x 112 x 112
    134 vs 165 us, 144 x 56 x 56 116 vs 137, 96 x 112 x 112 stride 2 241 vs 273, 192 x 28 x 28
    63 vs 91, 384 x 14 x 14 40 vs 55, 576 x 14 x 14 88 vs 103, 576 x 14 x 14 stride 2 43 vs 54,
    960 x 7 x 7 64 vs 73, 2 x 576 x 10 x 8 122 vs 139, 2 x 960 x 5 x 4 58 vs 96 (every layer
    faster; two rows lost to one as well). Whole runs, one process, min of 9 rounds:
    MobileNetV2 7.12 -> 6.69 ms at 1x3x224x224, 6.63 -> 6.41 ms at 2x3x160x128;
    mobilenet_v2_style 345 -> 316 us at 1x3x64x64, 1148 -> 943 us at 2x3x96x80. A 5x5
    filter's 25 taps leave no room for shared rows on any ISA: one row there by this rule,
    not measured (the zoo has no 5x5 depthwise layer)."""
    taps = kernel_h * kernel_w
    shared_inputs = (DEPTHWISE_ROWS + kernel_h - 1) * kernel_w
    return DEPTHWISE_ROWS if taps + DEPTHWISE_ROWS + shared_inputs <= isa.registers else 1


def conv2d_depthwise(data: te.Tensor, weight: te.Tensor, strides, padding, dilation,
                     vector_width: int, rows: int) -> te.Tensor:
    """Depthwise NCHW conv (weight [C, 1, KH, KW]; channel multiplier 1) with width vectors.

    The packing stage pads each channel and splits its rows into phases (`pack_input_phases`),
    so every vector load is contiguous. Tiles of `vector_width` columns cover the width with
    the last one shifted back (tail_tiles.py), so the width domain is max(out_w, vector_width);
    a tile is `rows` output rows high (`depthwise_rows`), so the row domain is rounded up to
    whole tiles (the packed input holds zero rows below) and the write-back skips rows past
    the output.
    """
    batch, channels, height, width = data.shape
    _, _, kernel_h, kernel_w = (int(d) for d in weight.shape)
    (stride_h, stride_w), (dil_h, dil_w) = strides, dilation
    top, left, bottom, right = padding
    out_h = output_extent(height, top, bottom, kernel_h, stride_h, dil_h)
    out_w = output_extent(width, left, right, kernel_w, stride_w, dil_w)
    tile_w = tirx.max(out_w, vector_width)
    tile_h = (out_h + rows - 1) // rows * rows
    packed_input = pack_input_phases(data, tile_w, kernel_w, strides, padding, dilation,
                                     "depthwise_input_phases",
                                     rows=(tile_h - 1) * stride_h + (kernel_h - 1) * dil_h + 1)
    ry = te.reduce_axis((0, kernel_h), "ry")
    rx = te.reduce_axis((0, kernel_w), "rx")

    def tile_value(n, c, oh, ow):
        tap = rx * dil_w
        pixel = packed_input[n, c, oh * stride_h + ry * dil_h, tap % stride_w, ow + tap // stride_w]
        return te.sum(pixel * weight[c, 0, ry, rx], axis=[ry, rx])

    window = [kernel_h, kernel_w, stride_h, stride_w, top, left, dil_h, dil_w]
    tiles = te.compute((batch, channels, tile_h, tile_w), tile_value, name="depthwise_tiles",
                       attrs={KERNEL_ANNOTATION: DEPTHWISE, ROWS_ANNOTATION: vector_width,
                              DEPTHWISE_ROWS_ANNOTATION: rows, OUTPUT_ROW_AXIS_ANNOTATION: 3,
                              DEPTHWISE_WINDOW_ANNOTATION: window})
    return te.compute((batch, channels, out_h, out_w), lambda n, c, h, w: tiles[n, c, h, w],
                      name="depthwise_out")


def schedule_depthwise(sch: s_tir.Schedule, tiles, out_block, row_extent, out_row_axis: int,
                       vector_width: int, rows: int, version: str,
                       parallel: bool = True) -> list[tuple]:
    """Depthwise tiles: one vector of output columns per tile (per row on maps narrower than
    a vector), the filter taps unrolled.

    The loop over (batch, channel) is fused and, when `parallel`, run on the thread pool; the
    packing stage moves under it, so each channel is padded just before its rows are convolved,
    while it sits in L1. Not on maps narrower than a vector (the SINGLE_ROW version): there the
    stage packs every channel first, into one buffer, because a buffer per channel inside the
    parallel loop is a workspace allocation per channel (its size is symbolic, so it is no
    stack array), which cost more than convolving a small plane (MobileNetV2's 960 x 5 x 4
    layer at batch 2: 47 -> 27 us; 576 x 10 x 8: 38 -> 27 us; on wide maps packing first
    was 5-10% slower). Fusing the output rows into the parallel loop as well would cost three
    divisions by symbolic extents per row to recover the indices, more than a row's 2-3 tiles
    (measured 2x slower on MobileNet's 64 x 48 x 40 layers). The tile buffer is a stack array
    in registers (isa.TILE_SCOPE, set for every kernel's tiles by schedule_kernels.py).
    """
    n, c, oh, ow, ry, rx = sch.get_loops(tiles)
    packing, = _packing_stages(sch, tiles)  # a depthwise kernel has one
    oh_outer, oh_inner = sch.split(oh, [None, rows])
    ow_outer, ow_lane = sch.split(ow, [None, vector_width])
    sch.reorder(n, c, oh_outer, ow_outer, ry, rx, oh_inner, ow_lane)
    sch.reverse_compute_at(out_block, ow_outer)
    channel = _fuse_outer_loops(sch, [n, c], parallel)
    if version == ROW_TILES:
        sch.compute_at(packing, channel)
    else:
        _fuse_outer_loops(sch, sch.get_loops(packing)[:2], parallel)
    _copy_filter_per_channel(sch, tiles, channel)
    sch.unroll(ry)
    sch.unroll(rx)
    sch.unroll(oh_inner)
    sch.vectorize(ow_lane)
    init = sch.decompose_reduction(tiles, ry)
    out_name = sch.get(out_block).name_hint
    row_iters = {sch.get(tiles).name_hint: 3, sch.get(init).name_hint: 3, out_name: out_row_axis}
    sch.vectorize(sch.get_loops(out_block)[-1])
    return (_column_tile_rewrites(sch, version, row_iters, vector_width, row_extent, out_name,
                                  ow_outer)
            + [("pack_rows", sch.get(packing).name_hint, vector_width,
                *_version_condition(version, row_extent, vector_width))])


def _version_condition(version: str, row_extent, tile_columns: int) -> list:
    """[what holds wherever this version runs (dispatch.row_buckets)], or [] for a static
    row extent: ROW_TILES runs on maps of a tile or wider, SINGLE_ROW on narrower ones."""
    if isinstance(row_extent, (int, tirx.IntImm)):
        return []
    return [row_extent >= tile_columns if version == ROW_TILES else row_extent < tile_columns]


def _column_tile_rewrites(sch: s_tir.Schedule, version: str, row_iters: dict, tile_columns: int,
                          row_extent, out_name: str, tile_loop) -> list[tuple]:
    """The rewrites of tiles of `tile_columns` output columns over the padded input.

    ROW_TILES: the last tile shifted back. Narrower outputs (MobileNet's 14x14 and 7x7 maps):
    one tile per row from column 0 (`tile_loop` cut to one iteration), reading the zeros the
    packed input holds up to a tile's width (a scalar loop per column ran MobileNetV2's
    576-channel 14x14 depthwise layer at 10 GMAC/s). The write-back is shifted like the tile so
    that all blocks index the tile alike and its buffer compacts to one tile (indexed
    differently, it kept the output's symbolic width: 2x slower); it keeps its bounds check,
    and row_chunks.masked_row_write_back then stores each row with one masked vector store.
    """
    if version == ROW_TILES:
        return [("shift", row_iters, tile_columns, row_extent)]
    return [("shift", row_iters, tile_columns, row_extent, frozenset({out_name})),
            ("restrict", sch.get(tile_loop).loop_var, 1),
            ("write_rows", out_name)]


def _copy_filter_per_channel(sch: s_tir.Schedule, tiles, channel) -> None:
    """Copy the channel's filter taps to a stack array under the channel loop: LLVM then
    proves they do not alias the output and keeps them in vector registers across the rows
    (read from the weight tensor, they were re-broadcast from memory at every tile;
    measured 1.25-1.4x faster)."""
    packed = {sch.get(block).writes[0].source.name for block in sch.get_producers(tiles)}
    own = sch.get(tiles).writes[0].source.name
    weight_index = next(index for index, region in enumerate(sch.get(tiles).reads)
                        if region.source.name not in packed | {own})
    sch.compute_at(sch.cache_read(tiles, weight_index, "global"), channel)


def _fuses_at_once(sch: s_tir.Schedule, loops: list) -> bool:
    """Whether TVM can fuse `loops`. Fusing [2 images, h - 2 rows, 3 channel panels] fails its
    divisibility proof (9h - 18 by 3h - 6) with an internal error, so a grouped conv without
    padding on a symbolic height did not compile. Where it cannot, the outermost loop alone is
    the parallel one: fusing them two at a time passes the proof, but the tail-tile rewrites
    (tail_tiles.py) expect the one fused loop, and a grouped 1x1 conv padded at the bottom then
    failed code generation."""
    try:
        sch.copy().fuse(*loops)
    except tvm.error.InternalError:
        return False
    return True


def _packing_stages(sch: s_tir.Schedule, tiles) -> list:
    return [block for block in sch.get_producers(tiles)
            if STAGE_ANNOTATION in sch.get(block).annotations]


def _fuse_outer_loops(sch: s_tir.Schedule, loops: list, parallel: bool):
    fused = sch.fuse(*loops) if _fuses_at_once(sch, loops) else loops[0]
    if parallel:
        sch.parallel(fused)
    return fused
