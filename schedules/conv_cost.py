"""The cost model that picks a convolution's algorithm (MNN §3.1 pre-inference).

MNN's rule: cost(direct / GEMM) = its multiply-adds; cost(Winograd F(n, k)) = the source
transform, the element-wise products (as a batched GEMM) and the destination transform, whose
sum falls and then rises with n, so the smallest is searched; plus the back-end's scheduling
cost, measured on real machines. Here each term is in seconds:
    multiply-adds / macs_per_second(kernel)
  + bytes moved by the packing and transform stages / bytes_per_second
  + transform arithmetic / transform_flops_per_second
  + packed or transformed weight bytes / bytes_per_second (read once a run: _with_weight_reads)
(Winograd's transforms and extra kernels are costed instead in multiply-add equivalents measured
against the width kernel, WINOGRAD_* below), with the three rates read from the knob database's
"rates" where recorded, else the defaults below: 60% of the vector unit's FMA peak at 3 GHz on
the target's cores for the register-tile GEMM, a quarter of that for the transforms (short,
shuffle-bound loops), 10 GB/s for memory. Zero padding of output channels to whole vector
panels counts as work, because the kernels do it.
The constants were measured on one host. Where a conv's candidates were timed on the target
(python/tightfit/algorithm_search.py, `tightfit search`), those times decide instead
(`with_measurements`): MNN's choice is calibrated on the device it runs on.
Every candidate also reports its memory: workspace (packed input, Winograd's transformed input
and GEMM result, im2col's unfolded input) and packed/transformed weight bytes, for the
budget-aware choice (FlexNN) and the memory plan.
Limits: symbolic extents are costed at a typical value (a symbolic plane also changes the
direct kernel's rate: _direct_efficiency); beyond im2col's reduction depth the
model has no cache model (a layer that fits L2 and one that does not cost the same per
multiply-add).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import tvm
from tvm import relax, tirx

from .conv2d import is_pointwise, width_tile_knobs
from .isa import VectorISA

BYTES_PER_FLOAT = 4
DEFAULT_CLOCK_HZ = 3.0e9
DEFAULT_GEMM_EFFICIENCY = 0.6
# What each conv kernel reaches of `macs_per_second`, measured on this host (AVX-512, 2
# threads, the zoo's 3x3 and 1x1 layers): conv2d_width_vectors ~150-160 GFLOP/s on maps a
# vector wide or more, conv2d_direct 60-105 GFLOP/s (its tiles are written back through a
# transpose), on 7x7 and 10-wide maps 36 GFLOP/s against the width kernel's 50-65.
KERNEL_EFFICIENCY = {"direct": 0.55, "width_vectors": 1.0}
# conv2d_direct over a filter of 9 taps or more (3x3), by input channels (linear in log2
# between, the end values beyond): its tiles reduce over the taps x the channels of the
# channels-last packed input, and from 32 channels on that runs faster than the width kernel.
# Timed alone with `tightfit search` (33 3x3 convs, 2 threads), direct / width kernel time:
# 3 channels 1.5-2.5, 8-12 channels 1.7-1.9, 16 channels 0.81-1.22, 24 channels 0.98-1.17,
# 32-48 channels 0.44-0.91, 64-256 channels 0.54-0.69, e.g. ResNet's stride-2 64 -> 128 conv
# at 56x56 914 against 1330 us and 128 -> 256 at 28x28 842 against 1348 us (the model ran
# both as width kernels). 1.45 is the least-squares fit (in log time) from 16 channels up;
# below 32 the model keeps 0.55, which picks the width kernel there: 16 and 24 channels are
# near ties alone, and detector_fpn's 24 -> 6 conv, a tie alone, ran its model 3-8% slower
# as direct. Over those convs and the zoo's 42 the chosen candidates' times sum to 9692 us
# (best 9623 us; with 0.55 throughout 10689 us). Filters of fewer taps keep 0.55: the 1x1
# stride-2 and 1x3 convs measured direct at 1.0-1.9x the width kernel's time. So do convs over
# a symbolic plane (all 33 were timed over static ones): the late layers are costed at a plane
# of a pixel or two, which the direct kernel runs a pixel at a time (dispatch.SINGLE_ROW).
# Before maps of 4 to 14 columns had short tiles (register_tile.SHORT_ROW_TILES), ResNet-18
# over a symbolic plane ran 9.9 ms at 1x3x128x128 with 0.55 and 13.0 ms with the fitted rate;
# with them both rates make the same choices there.
# Stride-1 convs timed since (one 3x3 conv alone over a static plane, 2 threads) ran no faster
# direct than in the width kernel: 32 ch at 16x16 29.3 against 30.2 us, 64 ch at 32x32 253
# against 185; so at 32 channels and 16x16 the model picks the direct kernel, where F(4,3)
# took 10.0 us. A refit over the zoo's convs (`tightfit search`) is due.
DIRECT_EFFICIENCY_BY_CHANNELS = {24: KERNEL_EFFICIENCY["direct"], 32: 1.45}
DEFAULT_BYTES_PER_SECOND = 10e9
WINOGRAD_TILES = {"winograd_f2": 2, "winograd_f4": 4}
# Winograd against the width kernel, measured on this host (AVX-512, 2 threads; ResNet-50's
# 64 -> 64 layer at 56x56, a 32 -> 32 one at 16x16 and resnet_style's 16 -> 16 at 32x32,
# kernel times from `--profile`): the per-point GEMMs run at 1.45x the width kernel's
# multiply-add rate with 64 input channels (258 against 177 GMAC/s: the reduction is the input
# channels), ~1.0x with 32 and about half with 16 (interpolated in log2 of the channels); a
# value through the input or the output transform costs ~100 ps (~18 of the width kernel's
# multiply-adds); each extra kernel about 1 us of thread-pool launch and VM call (200k).
# Checked again once the transforms stopped thrashing the L1 cache on planes of a multiple of
# 4 KB (winograd.py), one 3x3 conv alone over static and symbolic planes, Winograd / width
# kernel time (the model's ratio): static 16 ch 32x32 0.95 (1.23), 24 ch 32x32 1.10 (1.00),
# 32 ch 16x16 0.58 (0.90), 32x32 0.85 (0.62), 64 ch 28x28 0.37 (0.37), 32x32 0.40 (0.39),
# 56x56 0.29 (0.29), 128 ch 16x16 0.46 (0.54); symbolic 16 ch 32x32 0.60, 24 ch 32x32 1.14 and
# 64x64 0.76, 32 ch 16x16 0.73 and 32x32 0.85, 64 ch 0.31-0.44: the transforms now take as
# long over a symbolic plane as over a static one (11-28 multiply-adds a value either way), so
# a symbolic plane is costed like a static one. Wrong only for 16 channels at 32x32 (a tie
# over a static plane; over a symbolic one the width kernel is the slower one, 30 us against
# 16 static, which the model does not know). With the launch at 350k, as before, 32 channels at
# 16x16 took the width kernel, 1.7x (static) and 1.4x (symbolic) slower.
WINOGRAD_GEMM_EFFICIENCY = {16: 0.55, 32: 1.0, 64: 1.45}
WINOGRAD_MACS_PER_TRANSFORMED_VALUE = 18
KERNEL_LAUNCH_MACS = 200_000
# im2col + GEMM, measured on this host (AVX-512, 2 threads, one conv alone and in whole runs):
# the GEMM over the unfolded input runs as the pointwise width kernel while its reduction fits
# L1 with the weight panel (depth x (16 lanes + ~13 channel rows) x 4 bytes under 48 KB: depth
# <= IM2COL_L1_DEPTH), at IM2COL_DEEP_EFFICIENCY of it beyond (256 -> 256 3x3 on 14x14, depth
# 2304: 1.55 ms against the 3x3 width kernel's 1.0 ms; its reduction streams from L2, with no
# cache blocking); the unfolding kernel moves each value twice (0.2-0.7 ns a value measured, as
# the model's bytes at 10 GB/s); and a second kernel costs ~10 us inside a run (its launch, and
# its output read back from the other core: detector_fpn's 8 -> 16 3x3 stride-2 conv took 15
# us alone either way, 16 us in a run as the width kernel and 25 us as im2col + GEMM), counted
# in the width kernel's multiply-adds at its measured ~130 GMAC/s. Measured im2col / width:
# 0.73 and 0.77 on 1x1 stride-2 convs (ResNet's downsampling shortcuts: the unfolding is a
# subsample, and the width kernel packs every stride phase and wastes columns on short rows),
# 1.05-1.9 on the 3x3 convs tried; the model agrees on each.
IM2COL_L1_DEPTH = 384
IM2COL_DEEP_EFFICIENCY = 0.45
IM2COL_KERNEL_MACS = 1_300_000


@dataclass(frozen=True)
class ConvShape:
    batch: int
    channels: int
    height: int
    width: int
    out_channels: int
    kernel: tuple[int, int]
    strides: tuple[int, int]
    dilation: tuple[int, int]
    padding: tuple[int, int, int, int]
    groups: int
    # the image's height and width are known at compile time (costed as they are, not at a
    # typical extent)
    static_plane: bool = True
    static_batch: bool = True

    @property
    def out_hw(self) -> tuple[int, int]:
        top, left, bottom, right = self.padding
        (kh, kw), (sh, sw), (dh, dw) = self.kernel, self.strides, self.dilation
        return ((self.height + top + bottom - (kh - 1) * dh - 1) // sh + 1,
                (self.width + left + right - (kw - 1) * dw - 1) // sw + 1)

    @property
    def is_depthwise(self) -> bool:
        return self.groups > 1 and self.groups == self.channels == self.out_channels

    @property
    def measurement_key(self) -> str:
        """This conv's key for measured algorithm times in the knob database: its attributes
        and its batch, height and width, each `dyn` where symbolic (measured at one extent and
        used at all)."""
        dims = [str(value) if static else "dyn" for value, static
                in zip((self.batch, self.height, self.width),
                       (self.static_batch, self.static_plane, self.static_plane))]
        return ("conv2d/c{}/o{}/g{}/k{}x{}/s{}x{}/d{}x{}/p{}/n{}/h{}/w{}".format(
            self.channels, self.out_channels, self.groups, *self.kernel, *self.strides,
            *self.dilation, ",".join(map(str, self.padding)), *dims))

    @staticmethod
    def from_call(call: relax.Call, typical: dict) -> ConvShape:
        """The shape of a conv2d call, or of a conv1d call as the conv2d of a one-row image
        (as SelectConvAlgorithm runs it), each symbolic extent at its typical value."""
        attrs = call.attrs
        strides, dilation, padding = ([int(v) for v in values] for values
                                      in (attrs.strides, attrs.dilation, attrs.padding))
        dims = list(call.args[0].ty.shape.values)
        weight_dims = [int(d) for d in call.args[1].ty.shape.values]
        if len(dims) == 3:  # NCW: a one-row image, padded left and right only
            dims.insert(2, tirx.const(1, "int64"))
            weight_dims.insert(2, 1)
            strides, dilation = [1, *strides], [1, *dilation]
            padding = [0, padding[0], 0, padding[1]]
        n, c, h, w = (_typical(d, typical) for d in dims)
        o, _, kh, kw = weight_dims
        return ConvShape(n, c, h, w, o, (kh, kw), tuple(strides), tuple(dilation),
                         tuple(padding), int(attrs.groups),
                         all(isinstance(d, tirx.IntImm) for d in dims[2:]),
                         isinstance(dims[0], tirx.IntImm))


@dataclass(frozen=True)
class Candidate:
    name: str
    seconds: float  # estimated by the model
    macs: int
    workspace_bytes: int
    weight_bytes: int
    measured_seconds: float | None = None  # timed on the target (algorithm_search.py)

    def as_record(self) -> dict:
        record = {"name": self.name, "estimated_us": round(self.seconds * 1e6, 3),
                  "macs": self.macs, "workspace_bytes": self.workspace_bytes,
                  "weight_bytes": self.weight_bytes}
        if self.measured_seconds is not None:
            record["measured_us"] = round(self.measured_seconds * 1e6, 3)
        return record


@dataclass(frozen=True)
class Rates:
    macs_per_second: float
    transform_flops_per_second: float
    bytes_per_second: float

    @staticmethod
    def for_target(isa: VectorISA, threads: int, measured: dict | None) -> Rates:
        peak = isa.lanes * DEFAULT_CLOCK_HZ * max(1, threads)
        defaults = {"macs_per_second": peak * DEFAULT_GEMM_EFFICIENCY,
                    "transform_flops_per_second": peak * DEFAULT_GEMM_EFFICIENCY / 4,
                    "bytes_per_second": DEFAULT_BYTES_PER_SECOND}
        defaults.update(measured or {})
        return Rates(**defaults)


def candidate_costs(shape: ConvShape, isa: VectorISA, rates: Rates) -> list[Candidate]:
    if shape.is_depthwise:
        return [_with_weight_reads(_depthwise(shape, rates), rates)]
    width = _width_vectors(shape, isa, rates)
    if shape.groups > 1:  # the only kernel with groups (conv2d.py)
        return [_with_weight_reads(width, rates)]
    candidates = [_direct(shape, isa, rates), width]
    if not is_pointwise(*shape.kernel, shape.strides, shape.padding):
        candidates.append(_im2col(shape, isa, rates))
    if is_winograd_eligible(shape):
        candidates += [_winograd(shape, isa, width, name) for name in WINOGRAD_TILES]
    return [_with_weight_reads(candidate, rates) for candidate in candidates]


def _with_weight_reads(candidate: Candidate, rates: Rates) -> Candidate:
    """`candidate` with one read of its weights from memory a run: a network's weights outgrow
    the caches from one run to the next (ResNet-18: 47 MB, more with Winograd's transformed
    weights). The term tells only where the weights differ, so Winograd's, (m + 2)^2 / 9 times
    a 3x3 filter's: ResNet-18's 512 -> 512 3x3 convs at 4x4 ran Winograd F(2,3) in 523-547 us
    alone (direct 601-617 us, onnxruntime 524-598 us), but ~1000-1078 us inside a whole run,
    reading 16.8 MB of transformed weights. With the term its three such convs go to the direct
    kernel (9.4 MB of weights), and the model at 1x3x128x128 ran 10.4 -> 9.3-9.4 ms (2x3x96x112
    9.9-10.4 -> 9.8-9.9 ms), in one process, taking turns; no other zoo model changes its
    choices. Added last, as Winograd's costs are scaled from the width kernel's compute alone."""
    return replace(candidate, seconds=candidate.seconds
                   + candidate.weight_bytes / rates.bytes_per_second)


def with_measurements(candidates: list[Candidate], measured_us: dict | None) -> list[Candidate]:
    """The candidates timed on the target, with their times, where the knob database has a
    record of this conv (`measured_us`: name -> microseconds, None for a candidate that failed
    to compile or run there, which is never chosen); all candidates, estimated only, where it
    has none or timed none of them. A measurement outranks the model: MNN calibrates its
    choice on the device, and the model's constants were fitted on one host."""
    measured = [replace(c, measured_seconds=measured_us[c.name] * 1e-6) for c in candidates
                if measured_us and measured_us.get(c.name) is not None]
    return measured or candidates


# A measured candidate displaces the model's pick only when it measured this much faster. A
# conv is timed alone, its input in cache; in a model, a second kernel's launch and its output
# read back from the other core cost more, and near-ties are noise on a shared machine: on
# this host, conv_dynamic_hw's 12 -> 24 3x3 conv timed im2col 18.0 us against the width
# kernel's 18.5 us, and the model with im2col ran 1.12-1.43x slower; resnet_style's 16 -> 16
# 3x3 conv timed direct 34.9 us against 40.8 us (17% faster), and the model ran 0.81x (batch
# 1) and 0.95x (batch 4) with it.
MEASURED_MARGIN = 0.1


def choose(candidates: list[Candidate], max_workspace_bytes: int | None) -> Candidate:
    """The fastest candidate within the workspace limit; the smallest workspace if none fits.
    Among measured candidates (`with_measurements`) the fastest measured, unless the model's
    own pick measured within MEASURED_MARGIN of it."""
    fitting = [c for c in candidates
               if max_workspace_bytes is None or c.workspace_bytes <= max_workspace_bytes]
    if not fitting:
        return min(candidates, key=lambda c: c.workspace_bytes)
    estimated_pick = min(fitting, key=lambda c: c.seconds)
    if estimated_pick.measured_seconds is None:
        return estimated_pick
    measured_pick = min(fitting, key=lambda c: c.measured_seconds)
    if estimated_pick.measured_seconds <= measured_pick.measured_seconds * (1 + MEASURED_MARGIN):
        return estimated_pick
    return measured_pick


def is_winograd_eligible(shape: ConvShape) -> bool:
    return (shape.groups == 1 and shape.kernel == (3, 3) and shape.strides == (1, 1)
            and shape.dilation == (1, 1))


def _padded(channels: int, isa: VectorISA) -> int:
    return -(-channels // isa.lanes) * isa.lanes


def _direct(shape: ConvShape, isa: VectorISA, rates: Rates) -> Candidate:
    out_h, out_w = shape.out_hw
    kh, kw = shape.kernel
    macs = shape.batch * out_h * out_w * _padded(shape.out_channels, isa) * shape.channels * kh * kw
    top, left, bottom, right = shape.padding
    packed_input = shape.batch * shape.channels * (shape.height + top + bottom) * (shape.width + left + right)
    # the tiles are pixels x channels, written back to NCHW through a transpose in registers:
    # costed as one more pass over the output
    output = shape.batch * shape.out_channels * out_h * out_w
    moved = (2 * packed_input + 2 * output) * BYTES_PER_FLOAT
    seconds = macs / (rates.macs_per_second * _direct_efficiency(shape)) + moved / rates.bytes_per_second
    weights = _padded(shape.out_channels, isa) * shape.channels * kh * kw * BYTES_PER_FLOAT
    return Candidate("direct", seconds, macs, packed_input * BYTES_PER_FLOAT, weights)


def _width_vectors(shape: ConvShape, isa: VectorISA, rates: Rates) -> Candidate:
    """Tiles of output channels x one or two vectors of output columns
    (conv2d.conv2d_width_vectors): each row is covered in whole tiles (the shifted tail
    recomputes the rest), and for a
    pointwise conv the row is the image's whole flattened pixel plane. Narrower than a vector,
    a conv computes one whole vector per row; a pointwise conv goes pixel by pixel with its
    channel rows as the vector, using channel_rows of its lanes."""
    out_h, out_w = shape.out_hw
    kh, kw = shape.kernel
    pointwise = is_pointwise(*shape.kernel, shape.strides, shape.padding)
    # the one-vector tile for a pointwise conv, also one that gets two (width_tile_knobs):
    # costed at a typical extent, a late layer's map is a few pixels, where two vectors' fewer
    # channel rows cost much more, and six of MobileNetV2's pointwise layers went to
    # conv2d_direct, 4x slower on their real 14 x 14 maps
    knobs = width_tile_knobs(isa, shape.out_channels, groups=shape.groups,
                             vectors=1 if pointwise else None)
    channel_rows = knobs.rows
    rows, row_width = (1, out_h * out_w) if pointwise else (out_h, out_w)
    if row_width >= isa.lanes:
        tile_width = knobs.vectors * isa.lanes  # the shifted tail covers a row in whole tiles
        columns = -(-row_width // tile_width) * tile_width
    elif pointwise:
        columns = row_width * isa.lanes / min(channel_rows, isa.lanes)
    else:
        columns = isa.lanes
    out_channels = -(-shape.out_channels // channel_rows) * channel_rows
    group_channels = shape.channels // shape.groups
    macs = int(shape.batch * rows * columns * out_channels * group_channels * kh * kw)
    top, left, bottom, right = shape.padding
    packed_input = 0 if pointwise else (shape.batch * shape.channels * (shape.height + top + bottom)
                                        * (shape.width + left + right))
    seconds = (macs / (rates.macs_per_second * KERNEL_EFFICIENCY["width_vectors"])
               + 2 * packed_input * BYTES_PER_FLOAT / rates.bytes_per_second)
    weights = out_channels * group_channels * kh * kw * BYTES_PER_FLOAT
    return Candidate("width_vectors", seconds, macs, packed_input * BYTES_PER_FLOAT, weights)


def _im2col(shape: ConvShape, isa: VectorISA, rates: Rates) -> Candidate:
    """The unfolded input (conv2d.im2col: C x KH x KW channels per output pixel, written and read
    back) and the pointwise width-vectors GEMM over each image's flattened pixels, whose tiles
    waste no columns on short rows (IM2COL_* above). Workspace = the unfolded input."""
    out_h, out_w = shape.out_hw
    kh, kw = shape.kernel
    depth = shape.channels * kh * kw
    unfolded = shape.batch * depth * out_h * out_w
    gemm = _width_vectors(ConvShape(shape.batch, depth, out_h, out_w, shape.out_channels, (1, 1),
                                    (1, 1), (1, 1), (0, 0, 0, 0), 1), isa, rates)
    gemm_seconds = gemm.seconds / (1.0 if depth <= IM2COL_L1_DEPTH else IM2COL_DEEP_EFFICIENCY)
    seconds = (gemm_seconds + 2 * unfolded * BYTES_PER_FLOAT / rates.bytes_per_second
               + IM2COL_KERNEL_MACS / (rates.macs_per_second * KERNEL_EFFICIENCY["width_vectors"]))
    return Candidate("im2col", seconds, gemm.macs, unfolded * BYTES_PER_FLOAT, gemm.weight_bytes)


def _depthwise(shape: ConvShape, rates: Rates) -> Candidate:
    out_h, out_w = shape.out_hw
    kh, kw = shape.kernel
    macs = shape.batch * shape.channels * out_h * out_w * kh * kw
    top, left, bottom, right = shape.padding
    packed_input = shape.batch * shape.channels * (shape.height + top + bottom) * (shape.width + left + right)
    seconds = macs / rates.transform_flops_per_second + 2 * packed_input * BYTES_PER_FLOAT / rates.bytes_per_second
    return Candidate("depthwise", seconds, macs, packed_input * BYTES_PER_FLOAT,
                     shape.channels * kh * kw * BYTES_PER_FLOAT)


def _winograd(shape: ConvShape, isa: VectorISA, width: Candidate, name: str) -> Candidate:
    """F(m x m, 3 x 3) (winograd.py): alpha = m + 2 points per side, one GEMM per point, the
    transforms costed per transformed value and the two kernels it runs beyond a direct conv's
    one, all in the width kernel's multiply-adds (WINOGRAD_*, measured against that kernel's
    whole time, packing included), so at the width candidate's seconds per multiply-add."""
    tile = WINOGRAD_TILES[name]
    alpha = tile + 2
    out_h, out_w = shape.out_hw
    tiles = shape.batch * (-(-out_h // tile)) * (-(-out_w // tile))
    out_channels = _padded(shape.out_channels, isa)
    macs = alpha * alpha * tiles * shape.channels * out_channels
    transformed_input = alpha * alpha * tiles * shape.channels
    gemm_result = alpha * alpha * tiles * out_channels
    equivalent_macs = (macs / _winograd_gemm_efficiency(shape.channels)
                       + (transformed_input + gemm_result) * WINOGRAD_MACS_PER_TRANSFORMED_VALUE
                       + 2 * KERNEL_LAUNCH_MACS)
    seconds = equivalent_macs * width.seconds / width.macs
    workspace = (transformed_input + gemm_result) * BYTES_PER_FLOAT
    weights = alpha * alpha * shape.channels * out_channels * BYTES_PER_FLOAT
    return Candidate(name, seconds, macs, workspace, weights)


def _direct_efficiency(shape: ConvShape) -> float:
    if shape.kernel[0] * shape.kernel[1] < 9 or not shape.static_plane:
        return KERNEL_EFFICIENCY["direct"]
    return _log2_interpolated(DIRECT_EFFICIENCY_BY_CHANNELS, shape.channels)


def _winograd_gemm_efficiency(channels: int) -> float:
    return _log2_interpolated(WINOGRAD_GEMM_EFFICIENCY, channels)


def _log2_interpolated(measured: dict[int, float], channels: int) -> float:
    """`measured` (channels -> value) at `channels`: linear in log2 between the measured
    points, the end points' values beyond them."""
    points = sorted(measured.items())
    if channels <= points[0][0]:
        return points[0][1]
    for (low, low_value), (high, high_value) in zip(points, points[1:]):
        if channels <= high:
            share = math.log2(channels / low) / math.log2(high / low)
            return low_value + share * (high_value - low_value)
    return points[-1][1]


def _typical(dim, typical: dict) -> int:
    if isinstance(dim, tirx.IntImm):
        return int(dim.value)
    analyzer = tvm.sym.Analyzer()
    for var in tirx.analysis.undefined_vars(dim):
        analyzer.bind(var, typical.get(var.name, typical["default"]))
    value = analyzer.simplify(dim)
    return int(value.value) if isinstance(value, tirx.IntImm) else typical["default"]
