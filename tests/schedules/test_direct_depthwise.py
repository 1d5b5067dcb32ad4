"""The direct depthwise kernels (schedules/direct_depthwise.py) take a strided depthwise conv's
output rows of at most a vector, a unit-stride one's planes narrower than a vector, and
outputs a vector wide and DIRECT_TILE_ROWS high in row tiles; they match
onnxruntime for every window and map size on both sides of the run-time dispatches, and leave
to the packed kernel what they do not cover.

They are built where masked loads and stores are fast (isa.VectorISA.fast_masks: AVX-512), so
the tests of their structure schedule for an AVX-512 CPU, whatever the host. The tests that run
them compile for the host: on one without fast masks (an AVX2 host) they check the packed
kernel that host's builds hold instead."""

import re

import numpy as np
import onnx
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import tightfit
from tightfit.feeds import run_onnxruntime
from tightfit.frontend import import_onnx
from tightfit.pipeline import PipelineOptions, run_pipeline
from tightfit.schedules.direct_depthwise import DIRECT_TILE_ROWS, FLAT_PLANE_MAX_PIXELS
from tightfit.schedules.isa import isa_for_target
from tightfit.target import resolve_target

from conftest import THRESHOLDS
from kernel_harness import AVX512_TARGET, sessions_on_each_side
from test_row_kernels import scheduled_kernel

CHANNELS = 5
# (kernel, strides, pads top/left/bottom/right)
WINDOWS = [
    ((3, 3), (2, 2), (1, 1, 1, 1)),  # MobileNet's stride-2 layers
    ((3, 3), (2, 2), (0, 0, 0, 0)),  # no padding: every load starts inside the row
    ((5, 5), (2, 2), (2, 2, 2, 2)),  # EfficientNet's 5x5: three tap groups per row
    ((3, 3), (3, 3), (1, 1, 1, 1)),  # three phases per load
    ((3, 5), (1, 2), (1, 2, 0, 1)),  # uneven kernel, strides and pads
    ((3, 3), (1, 1), (1, 1, 1, 1)),  # MobileNet's unit-stride layers: narrow planes read flat
    ((5, 3), (1, 1), (2, 1, 2, 1)),  # an uneven kernel keeping the map's size, flat too
    ((3, 3), (1, 1), (0, 0, 0, 0)),  # unit stride shrinking the map: row tiles only
]


def depthwise_model(kernel, strides, pads, epilogue: str = "clip",
                    spatial=("h", "w")) -> onnx.ModelProto:
    """A depthwise conv with a bias, then Clip(0, 6) (MobileNet's ReLU6) or Relu; or the sum of
    two such convs of x (the second one's epilogue reads the first one's output along the row,
    as a residual add does)."""
    rng = np.random.default_rng(0)
    filters = [rng.standard_normal((CHANNELS, 1, *kernel)).astype(np.float32) for _ in range(2)]
    initializers = [numpy_helper.from_array(values, name)
                    for values, name in zip(filters, ("w", "w2"))] + [
        numpy_helper.from_array(rng.standard_normal(CHANNELS).astype(np.float32), "b"),
        numpy_helper.from_array(np.array(0, np.float32), "low"),
        numpy_helper.from_array(np.array(6, np.float32), "high")]
    conv = {"kernel_shape": kernel, "strides": strides, "pads": pads, "group": CHANNELS}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["conv"], **conv)]
    if epilogue == "clip":
        nodes.append(helper.make_node("Clip", ["conv", "low", "high"], ["y"]))
    elif epilogue == "relu":
        nodes.append(helper.make_node("Relu", ["conv"], ["y"]))
    else:
        nodes += [helper.make_node("Conv", ["x", "w2"], ["other"], **conv),
                  helper.make_node("Add", ["other", "conv"], ["y"])]
    graph = helper.make_graph(
        nodes, "depthwise",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", CHANNELS, *spatial])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", CHANNELS, "oh", "ow"])],
        initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def compiled_windows(tmp_path_factory) -> list[dict]:
    """For each window, its model and a session compiled for each side of the work `if`."""
    models = [depthwise_model(*window, epilogue="relu" if index % 2 else "clip")
                   for index, window in enumerate(WINDOWS)]
    return sessions_on_each_side(models, tmp_path_factory.mktemp("knobs"))


def test_each_direct_kernel_is_a_version_where_it_applies(knob_database):
    """A strided conv's kernel holds the direct version for rows of at most a vector (its sums,
    masked loads of the input) and the row tiles; a unit-stride conv keeping the map's size,
    the flat version over the plane's pixels and the row tiles; a unit-stride conv that shrinks
    the map, the row tiles only; a 5x5 filter, whose tile would not fit the registers, no row
    tiles. Each keeps the packed kernel for the maps its direct versions do not take."""
    def scheduled(window):
        return scheduled_kernel(depthwise_model(*window), "depthwise", knob_database, AVX512_TARGET)

    strided = scheduled(WINDOWS[0])
    assert "depthwise_sums" in strided and re.search(r'T\.masked_load\("float32x\d+", x,', strided)
    assert "row_group" in strided and "depthwise_input_phases" in strided
    same_size = scheduled(WINDOWS[5])
    assert "pixel_vector" in same_size and "row_group" in same_size
    assert "depthwise_input_phases" in same_size
    shrinking = scheduled(WINDOWS[7])
    assert "row_group" in shrinking and "pixel_vector" not in shrinking
    assert "depthwise_input_phases" in shrinking
    for window in [((5, 5), (1, 1), (2, 2, 2, 2)), WINDOWS[2]]:  # 5x5 at stride 1 and 2
        five_by_five = scheduled(window)
        assert "depthwise_sums" in five_by_five and "row_group" not in five_by_five


def test_an_epilogue_that_reads_along_the_row_keeps_the_packed_kernel(knob_database):
    """The conv whose epilogue adds the other conv's output reads that output at every column:
    masked lanes would read past its row, so the packed kernel, whose write-back handles any
    epilogue, keeps those rows; the other conv (bias only) reads its narrow rows directly."""
    model = depthwise_model(*WINDOWS[0], epilogue="add")
    scheduled, _ = run_pipeline(import_onnx(model).mod, resolve_target(AVX512_TARGET),
                                PipelineOptions(knob_database=knob_database),
                                stop_after="tightfit.FallbackCPUSchedule")
    kernels = [func.script() for global_var, func in scheduled.functions.items()
               if "depthwise" in global_var.name_hint]
    adds_the_other = [re.search(r"depthwise_tiles\w*\[[^]]*\] \+ \w+\[v_n, v_c, v_h, v_w\]", kernel)
                      is not None for kernel in kernels]
    assert sorted(adds_the_other) == [False, True]
    for kernel, adds in zip(kernels, adds_the_other):
        assert ("depthwise_sums" in kernel) != adds
    feeds = {"x": np.random.default_rng(1).standard_normal((1, CHANNELS, 9, 7)).astype(np.float32)}
    np.testing.assert_allclose(tightfit.compile(model).session().run(feeds)["y"],
                               run_onnxruntime(model, feeds)["y"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window, spatial", [(WINDOWS[0], (7, 5)), (WINDOWS[5], (7, 5)),
                                             (WINDOWS[5], (9, 20))],
                         ids=["strided", "flat", "row_tiles"])
def test_serial_and_parallel_versions_compile_side_by_side(window, spatial):
    """With the default parallel threshold and only the batch symbolic (a 7x5 map: the strided
    or the flat kernel alone; 9x20: the row tiles alone, their last tile shifted back over the
    first), the kernel holds both work versions of the direct kernel, each with loop variables
    of its own (one variable in both loops failed code generation), each matching
    onnxruntime."""
    model = depthwise_model(*window, spatial=spatial)
    session = tightfit.compile(model).session()
    for batch in (1, 1200):  # below and above the threshold
        feeds = {"x": np.random.default_rng(batch).standard_normal((batch, CHANNELS, *spatial))
                 .astype(np.float32)}
        np.testing.assert_allclose(session.run(feeds)["y"], run_onnxruntime(model, feeds)["y"],
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [0, 3, 5, 6, 7])
def test_row_tiles_match_onnxruntime_on_both_sides_of_their_edges(compiled_windows, window):
    """The row tiles run from DIRECT_TILE_ROWS output rows and a vector of output columns (at a
    stride, from just over a vector: rows of one vector are the strided direct kernel's): maps
    on both sides of each edge, a last tile shifted back over one to all but one of the rows
    before it, serial and parallel."""
    kernel, strides, pads = WINDOWS[window]
    rows, lanes = DIRECT_TILE_ROWS, isa_for_target(resolve_target("host").tvm_target).lanes
    for out_height, out_width in [(rows, lanes), (rows - 1, lanes), (rows, lanes - 1),
                                  (rows + 1, lanes + 1), (2 * rows - 1, 2 * lanes - 1),
                                  (2 * rows + 1, 40)]:
        height = (out_height - 1) * strides[0] + kernel[0] - pads[0] - pads[2]
        width = (out_width - 1) * strides[1] + kernel[1] - pads[1] - pads[3]
        feeds = {"x": np.random.default_rng(height * width).standard_normal(
            (2, CHANNELS, height, width)).astype(np.float32)}
        expected = run_onnxruntime(compiled_windows[window]["model"], feeds)["y"]
        assert expected.shape[2:] == (out_height, out_width)
        for side in THRESHOLDS:
            np.testing.assert_allclose(compiled_windows[window][side].run(feeds)["y"], expected,
                                       rtol=1e-5, atol=1e-5, err_msg=f"{side}, {feeds['x'].shape}")


@pytest.mark.parametrize("rows, kernels", [(DIRECT_TILE_ROWS, {"row_group"}),
                                           (DIRECT_TILE_ROWS - 1, {"depthwise_input_phases"})])
def test_a_static_map_compiles_only_the_kernel_that_runs_there(knob_database, rows, kernels):
    """Over a static map the dispatch is decided when compiling: a 20-wide map from
    DIRECT_TILE_ROWS output rows up holds the row tiles alone, one row fewer the packed kernel
    alone."""
    scheduled = scheduled_kernel(depthwise_model(*WINDOWS[7], spatial=(rows + 2, 22)),
                                 "depthwise", knob_database, AVX512_TARGET)
    present = {name for name in ("row_group", "depthwise_input_phases") if name in scheduled}
    assert present == kernels


def test_a_plane_too_tall_for_float_columns_keeps_the_packed_kernel(compiled_windows):
    """The flat kernel finds columns in float32, exact below FLAT_PLANE_MAX_PIXELS a plane: a
    narrow plane of more pixels runs the packed kernel's narrow version, and matches."""
    width = 15
    height = FLAT_PLANE_MAX_PIXELS // width + 1
    feeds = {"x": np.random.default_rng(5).standard_normal((1, CHANNELS, height, width))
             .astype(np.float32)}
    compiled = compiled_windows[5]
    np.testing.assert_allclose(compiled["serial"].run(feeds)["y"],
                               run_onnxruntime(compiled["model"], feeds)["y"], rtol=1e-5, atol=1e-5)


@given(window=st.integers(0, len(WINDOWS) - 1), batch=st.integers(1, 2),
       height=st.integers(1, 24), width=st.integers(1, 45), seed=st.integers(0, 2 ** 16))
@settings(max_examples=60, deadline=None)
def test_direct_depthwise_matches_onnxruntime_at_any_map_size(compiled_windows, window, batch,
                                                              height, width, seed):
    """Rows narrower than a vector (the direct kernel: masked vectors only, or a left-padding
    vector, plain ones and a masked end) and wider ones (the packed kernel, or from
    DIRECT_TILE_ROWS rows the row tiles, their last tile shifted back), serial and parallel,
    each checked against onnxruntime."""
    kernel, _, pads = WINDOWS[window]
    assume(height + pads[0] + pads[2] >= kernel[0] and width + pads[1] + pads[3] >= kernel[1])
    feeds = {"x": np.random.default_rng(seed).standard_normal((batch, CHANNELS, height, width))
             .astype(np.float32)}
    compiled = compiled_windows[window]
    expected = run_onnxruntime(compiled["model"], feeds)["y"]
    for side in THRESHOLDS:
        np.testing.assert_allclose(compiled[side].run(feeds)["y"], expected, rtol=1e-5,
                                   atol=1e-5, err_msg=f"{side}, window {WINDOWS[window]}")


@pytest.mark.parametrize("target", [
    {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]},
    {"kind": "llvm", "mcpu": "znver3"}], ids=["arm64", "avx2"])
def test_targets_without_fast_masked_stores_keep_the_packed_kernel(target):
    """NEON has no masked loads or stores (LLVM moves them lane by lane) and AMD Zen's AVX2
    masked store (vmaskmovps) is slow: their builds keep the packed kernel for every row width.
    On an AMD AVX2 host (2 threads, MobileNetV2's depthwise layers alone at 2x3x160x128) the
    direct kernels ran 960 x 5x4 15% faster and 576 x 10x8 -> 5x4 at stride 2, whose 4-wide
    rows are each one masked store, 50% slower (47 -> 71 us)."""
    for window in (WINDOWS[0], WINDOWS[5]):
        kernel = scheduled_kernel(depthwise_model(*window), "depthwise", target=target)
        assert "depthwise_sums" not in kernel and "depthwise_input_phases" in kernel
