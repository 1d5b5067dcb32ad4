"""Winograd F(m x m, 3 x 3): the transform matrices, and where the cost model uses them."""

import dataclasses
import re

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from tvm import tirx

import tightfit
from tightfit.feeds import run_onnxruntime
from tightfit.frontend import import_onnx
from tightfit.pipeline import PipelineOptions, run_pipeline
from tightfit.schedules.conv_cost import ConvShape, Rates, candidate_costs, choose
from tightfit.schedules.isa import AVX512
from tightfit.schedules.winograd import MATRICES
from tightfit.target import resolve_target

from kernel_harness import compile_keeping, selected_algorithms


def as_array(matrix) -> np.ndarray:
    return np.array([[float(entry) for entry in row] for row in matrix])


@pytest.mark.parametrize("tile", [2, 4])
@pytest.mark.parametrize("seed", range(5))
def test_transforms_compute_a_3x3_correlation(tile, seed):
    """A^T [(G g G^T) (.) (B^T d B)] A is the m x m valid correlation of d with g."""
    b_transpose, g_matrix, a_transpose = (as_array(m) for m in MATRICES[tile])
    rng = np.random.default_rng(seed)
    alpha = tile + 2
    d, g = rng.standard_normal((alpha, alpha)), rng.standard_normal((3, 3))
    products = (g_matrix @ g @ g_matrix.T) * (b_transpose @ d @ b_transpose.T)
    expected = np.array([[np.sum(d[i:i + 3, j:j + 3] * g) for j in range(tile)]
                         for i in range(tile)])
    np.testing.assert_allclose(a_transpose @ products @ a_transpose.T, expected, atol=1e-9)


def conv(batch, channels, size, out_channels) -> ConvShape:
    return ConvShape(batch, channels, size, size, out_channels, (3, 3), (1, 1), (1, 1),
                     (1, 1, 1, 1), 1)


@pytest.mark.parametrize("shape, expected", [
    (conv(1, 64, 56, 64), "winograd_f4"),  # ResNet-50's layer: measured 232 us, width 662 us
    (conv(1, 16, 32, 16), "width_vectors"),  # resnet_style's: the thin GEMMs lose
    (conv(1, 3, 32, 16), "width_vectors"),  # a stem: almost nothing to save
])
def test_cost_model_uses_winograd_where_it_measured_faster(shape, expected):
    costs = candidate_costs(shape, AVX512, Rates.for_target(AVX512, 2, None))
    assert choose(costs, None).name == expected


@pytest.mark.parametrize("channels, size", [(32, 16), (32, 32), (64, 32)])
def test_winograd_is_costed_alike_over_static_and_symbolic_planes(channels, size):
    """The transforms take as long over a symbolic plane as over a static one (winograd.py's
    cache fixes), and F(4,3) measured faster than the width kernel at these convs either way:
    32 channels at 16x16 10.0 / 30.2 us static and 11.9 / 16.3 symbolic, at 32x32 38.3 / 51.1
    and 42.7 / 50.3, 64 channels at 32x32 73.1 / 185.3 and 81.7 / 184.6 (conv_cost.py).
    Before, a symbolic plane tripled their cost and 32 channels ran the width kernel there."""
    rates = Rates.for_target(AVX512, 2, None)
    static = conv(1, channels, size, channels)
    symbolic = dataclasses.replace(static, static_plane=False)
    costs = [{c.name: c.seconds for c in candidate_costs(shape, AVX512, rates)}
             for shape in (static, symbolic)]
    assert costs[0]["winograd_f4"] == costs[1]["winograd_f4"]
    assert choose(candidate_costs(symbolic, AVX512, rates), None).name == "winograd_f4"


@pytest.mark.parametrize("plane, expected", [((32, 32), "direct"), (("h", "w"), "width_vectors")])
def test_the_pass_sees_whether_a_conv_plane_is_symbolic(plane, expected):
    """SelectConvAlgorithm costs a conv over a symbolic plane as one (ConvShape.from_call): the
    direct kernel's rate fitted from 32 channels up holds over static planes only
    (conv_cost._direct_efficiency), so between it and the width kernel the plane decides."""
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((32, 32, 3, 3)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, *plane])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32, None, None])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    selected, _ = run_pipeline(import_onnx(model).mod, resolve_target("host"),
                               PipelineOptions(conv_algorithms=("direct", "width_vectors")),
                               stop_after="tightfit.SelectConvAlgorithm")
    assert selected_algorithms(selected) == [expected]


def test_winograd_workspace_counts_the_transformed_input_and_products():
    """A memory budget sees what Winograd holds at run time (FlexNN's kernel choice)."""
    shape = conv(1, 64, 56, 64)
    costs = {c.name: c for c in candidate_costs(shape, AVX512, Rates.for_target(AVX512, 2, None))}
    tiles = (56 // 4) ** 2
    assert costs["winograd_f4"].workspace_bytes == 2 * 36 * tiles * 64 * 4
    assert choose(list(costs.values()), max_workspace_bytes=1 << 20).name != "winograd_f4"


def test_a_grouped_conv_is_costed_on_its_groups_channels_with_width_vectors_only():
    """ResNeXt's 3x3 in 32 groups of 4 channels: no Winograd or direct candidate (they take no
    groups), multiply-adds and weights over each group's 4 input channels."""
    grouped = ConvShape(1, 128, 28, 28, 128, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 32)
    costs = candidate_costs(grouped, AVX512, Rates.for_target(AVX512, 2, None))
    assert [c.name for c in costs] == ["width_vectors"]
    # 28 rows of two 16-lane vectors, 128 output channels in whole 4-row tiles
    assert costs[0].macs == 28 * 32 * 128 * 4 * 9
    assert costs[0].weight_bytes == 128 * 4 * 9 * 4


def test_im2col_holds_the_unfolded_input_and_loses_where_it_measured_slower():
    """The explicit im2col candidate's workspace is the unfolded input (C x 3 x 3 values per
    output pixel); on the 3x3 convs it was measured on it costs more than the width kernel, as
    it ran (1.05-1.9x slower)."""
    rates = Rates.for_target(AVX512, 2, None)
    for channels, out_channels, size, stride in [(64, 64, 7, 1), (16, 32, 32, 2), (3, 32, 224, 2),
                                                 (256, 256, 14, 1)]:
        shape = ConvShape(1, channels, size, size, out_channels, (3, 3), (stride, stride), (1, 1),
                          (1, 1, 1, 1), 1)
        costs = {c.name: c for c in candidate_costs(shape, AVX512, rates)}
        out_size = (size - 1) // stride + 1
        assert costs["im2col"].workspace_bytes == channels * 9 * out_size * out_size * 4
        assert costs["im2col"].seconds > costs["width_vectors"].seconds
    pointwise = ConvShape(1, 16, 8, 8, 16, (1, 1), (1, 1), (1, 1), (0, 0, 0, 0), 1)
    assert "im2col" not in [c.name for c in candidate_costs(pointwise, AVX512, rates)]


@pytest.mark.parametrize("channels, size", [(120, 24), (64, 56), (256, 28)])
def test_im2col_is_chosen_for_strided_1x1_convs_where_it_measured_faster(channels, size):
    """ResNet's downsampling shortcut (1x1, stride 2): unfolding is a subsample, and the GEMM
    over the flattened pixels wastes no columns (measured 0.73x and 0.77x the width kernel's time)."""
    shape = ConvShape(1, channels, size, size, 2 * channels, (1, 1), (2, 2), (1, 1),
                      (0, 0, 0, 0), 1)
    assert choose(candidate_costs(shape, AVX512, Rates.for_target(AVX512, 2, None)),
                  None).name == "im2col"


def scheduled_over_a_symbolic_plane(channels: int, algorithm: str):
    """The scheduled module of a 3x3 conv over a 1 x channels x h x w image, with `algorithm`."""
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((channels, channels, 3, 3))
                                     .astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, channels, None, None])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    scheduled, _ = run_pipeline(import_onnx(model).mod, resolve_target("host"),
                                PipelineOptions(conv_algorithms=(algorithm,)),
                                stop_after="tightfit.FallbackCPUSchedule")
    return scheduled


def test_transforms_over_a_symbolic_plane_take_plain_tile_indices_and_channel_vectors():
    """24 channels over h x w: both transforms vectorize over 8-lane channel vectors (24 is no
    whole number of 16-lane ones, and LLVM left the loop scalar over a symbolic plane), and the
    input transform's tile row and column are loops of their own, not a division and remainder
    of one tile number by the symbolic tile count."""
    scheduled = scheduled_over_a_symbolic_plane(24, "winograd_f4")
    scripts = {global_var.name_hint: func.script() for global_var, func in scheduled.functions.items()
               if "winograd" in global_var.name_hint}
    input_script = scripts["winograd_input"]
    output_script, = [text for name, text in scripts.items() if "winograd_output" in name]
    for script in (input_script, output_script):
        assert "T.vectorized(T.int64(8))" in script
    assert "v_t //" not in input_script and "v_t %" not in input_script
    assert re.search(r"for n_row_fused in T\.parallel", input_script)


@pytest.mark.parametrize("algorithm, packed", [("winograd_f4", "winograd_input_nhwc"),
                                               ("direct", "conv2d_input_nhwc")])
def test_channels_last_packing_gathers_eight_channels_per_column(algorithm, packed):
    """The channels-last copy of the input walks every column of a row for 8 channels at a
    time: all channels per column, each column's gather from the channel planes evicted the
    planes' rows the next columns needed wherever a plane is a multiple of 4 KB (Winograd's
    input transform at 64 x 32x32: 57.7 -> 12.7 us; conv2d.gather_channels_in_blocks)."""
    scheduled = scheduled_over_a_symbolic_plane(64, algorithm)
    script = next(func.script() for func in scheduled.functions.values()
                  if f'T.sblock("{packed}")' in func.script())
    # in every version of the kernel the loops (channel block, column, channel) innermost
    loops = re.findall(r"for (?:\w+, )*(\w+), (\w+), (\w+) in T\.grid\((.*)\):\n\s*"
                       rf'with T\.sblock\("{packed}"\)', script)
    assert len(loops) == script.count(f'T.sblock("{packed}")') > 0, script
    for channel_block, column, channel, extents in loops:
        assert (channel_block[0], column[0], channel[0]) == ("c", "w", "c")
        # 64 channels: 8 blocks of 8
        assert re.search(r"T\.int64\(8\), .+, T\.int64\(8\)$", extents), extents


def test_transformed_tiles_keep_their_points_together_and_write_back_8_lanes():
    """V and M hold a tile's 36 points side by side ([n, tile, point, channel]): with the point
    outermost, a tile's 36 vectors lay a plane of tiles apart, all in one L1 set where that
    plane is a multiple of 4 KB. The output transform stores channel vectors of 8 lanes, which
    scatter over 8 output planes, not 16 (winograd.OUTPUT_CHANNEL_LANES), each over the whole
    row of tiles before the next vector."""
    scheduled = scheduled_over_a_symbolic_plane(64, "winograd_f4")
    for kernel in ("winograd_input", "dense_packed"):  # V, then M (the GEMM's result)
        result = scheduled[scheduled.get_global_var(kernel)].params[-1]
        assert [int(dim) for dim in result.shape[-2:]] == [36, 64], (kernel, result.shape)
    output_script, = [func.script() for var, func in scheduled.functions.items()
                      if "winograd_output" in var.name_hint]
    assert "T.vectorized(T.int64(8))" in output_script
    assert "T.vectorized(T.int64(16))" not in output_script
    # the channel vectors outside the tile columns, in every version
    orders = re.findall(r"for (?:\w+, )*k_0, w_0, h_1 in T\.grid", output_script)
    assert len(orders) == output_script.count("T.sblock(\"winograd_output_tiles\")") > 0


@pytest.mark.parametrize("algorithm, alpha", [("winograd_f2", 4), ("winograd_f4", 6)])
def test_the_input_transform_reads_each_input_vector_of_a_tile_once(algorithm, alpha):
    """Only the window of a tile column reads the packed input (alpha vectors, one loop), and
    the partial sums read only the window. Read per row xi instead (alpha times the reads, each
    indexing a buffer over the symbolic plane), TVM's lowering of an F(4x4) kernel took 2.4 s
    instead of 0.36 s."""
    scheduled = scheduled_over_a_symbolic_plane(32, algorithm)
    script = scheduled["winograd_input"].script().split("version_1")[0]  # the parallel version
    reads = {name: set(re.findall(r"(\w+)\[", region)) for name, region in re.findall(
        r'T\.sblock\("(\w+)"\):.*?T\.reads\((.*?)\)\n', script, re.DOTALL)}
    packed, window = "winograd_input_nhwc", "winograd_input_nhwc_local"
    assert [name for name, buffers in reads.items() if packed in buffers] == [window]
    assert reads["winograd_input_rows"] == {window}
    loops_over_window = re.search(r"((?:\s*for \w+ in T\.\w+\(T\.int64\(\d+\)\):\n)+)\s*"
                                  rf'with T\.sblock\("{window}"\)', script).group(1)
    # the tile column's j, then the window's alpha rows, each a vector of channels
    (j, rows, lanes) = re.findall(r"T\.(\w+)\(T\.int64\((\d+)\)\)", loops_over_window)
    assert j == rows == ("unroll", str(alpha)) and lanes[0] == "vectorized"


def test_the_input_transform_reads_a_pooled_plane_as_plain_symbols():
    """After a stride-2 max pool the conv's plane is (h - 1) // 2 + 1 by (w - 1) // 2 + 1; the
    input transform's PrimFunc takes it as plain variables read from the tensor (kernel_call's
    `plain_dims`: TIR lowering took 25-32 s per kernel over the expressions), and computes what
    onnxruntime does at odd and even planes."""
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array((0.1 * rng.standard_normal((16, 16, 3, 3))).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MaxPool", ["x"], ["p"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
         helper.make_node("Conv", ["p", "w"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["y"])], "pooled_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16, "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 16, "oh", "ow"])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    package, selected = compile_keeping(model, "tightfit.SelectConvAlgorithm",
                                        options=PipelineOptions(conv_algorithms=("winograd_f4",)))
    transform = selected[selected.get_global_var("winograd_input")]
    image, tiles = transform.params  # no symbols passed beside them
    assert all(isinstance(dim, (tirx.IntImm, tirx.Var)) for dim in image.shape), image.shape
    plane = {dim for dim in image.shape if isinstance(dim, tirx.Var)}
    assert {var for dim in tiles.shape for var in tirx.analysis.undefined_vars(dim)} <= plane
    session = package.session()
    for shape in [(1, 16, 23, 30), (2, 16, 16, 9)]:
        feeds = {"x": rng.standard_normal(shape).astype(np.float32)}
        np.testing.assert_allclose(session.run(feeds)["y"], run_onnxruntime(model, feeds)["y"],
                                   rtol=1e-4, atol=1e-4)
