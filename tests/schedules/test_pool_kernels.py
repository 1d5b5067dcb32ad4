"""The max pool kernel (schedules/pool_kernels.py) matches onnxruntime for every window, map
size and side of the work `if`, and leaves what it does not cover to the fallback."""

import numpy as np
import onnx
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import tightfit
from tightfit.feeds import run_onnxruntime

from conftest import THRESHOLDS
from kernel_harness import sessions_on_each_side
from test_row_kernels import scheduled_kernel

# (kernel, strides, pads top/left/bottom/right, ceil_mode)
WINDOWS = [
    ((2, 2), (2, 2), (0, 0, 0, 0), 0),  # conv_dynamic_hw's
    ((3, 3), (2, 2), (1, 1, 1, 1), 0),  # a ResNet stem's
    ((3, 3), (1, 1), (1, 1, 1, 1), 0),  # same-size pooling: unit stride, no shuffles
    ((2, 3), (1, 2), (0, 1, 1, 2), 0),  # uneven kernel, strides and pads
    ((3, 3), (2, 2), (0, 0, 0, 0), 1),  # ceil mode: the last window reaches past the map
    ((3, 3), (3, 3), (1, 1, 1, 1), 0),  # three phases per load
    ((1, 1), (2, 2), (0, 0, 0, 0), 0),  # a kernel narrower than its stride
]


def max_pool_model(kernel, strides, pads, ceil_mode, dilations=(1, 1)) -> onnx.ModelProto:
    node = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=kernel, strides=strides,
                            pads=pads, ceil_mode=ceil_mode, dilations=dilations)
    graph = helper.make_graph(
        [node], "max_pool",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3, "oh", "ow"])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def compiled_windows(tmp_path_factory) -> list[dict]:
    """For each window, its model and a session compiled for each side of the work `if`."""
    models = [max_pool_model(*window) for window in WINDOWS]
    return sessions_on_each_side(models, tmp_path_factory.mktemp("knobs"))


def test_max_pool_reads_vectors_of_columns_without_a_padded_copy(knob_database):
    kernel = scheduled_kernel(max_pool_model(*WINDOWS[1]), "max_pool", knob_database)
    assert "window_max" in kernel and "T.Shuffle" in kernel
    assert "pad_temp" not in kernel and "sblock_alloc_buffer" not in kernel


def test_a_row_too_narrow_for_a_vector_is_pooled_in_masked_vectors(knob_database):
    """A map whose output row is narrower than a vector (conv_dynamic_hw's 20-wide map pools to
    10 columns) takes masked vector loads and stores in place of a scalar loop over every column
    and tap (its pool ran 7.2 us, with masked vectors 2.1 us); the lanes past the row read
    nothing and count as the lowest float, and only the row's own columns are stored."""
    for window in (WINDOWS[0], WINDOWS[1], WINDOWS[3]):
        kernel = scheduled_kernel(max_pool_model(*window), "max_pool", knob_database)
        assert "T.masked_load" in kernel and "T.masked_store" in kernel, window


def test_bounds_checks_do_not_multiply_with_the_window():
    """A tap's row (and an edge column's tap) is checked inside a loop over the window, not in a
    statement of its own: with a statement per tap, TVM's buffer region analyses reasoned about
    every check (grouped_convnet's 3x3 pool took 1.9 s to compile, 0.7 s with the loops). Every
    window's kernel has as many branches as a 1x1 window's."""
    def branches(window) -> int:
        kernel = scheduled_kernel(max_pool_model(*window), "max_pool")
        return sum(line.strip().startswith("if ") for line in kernel.splitlines())

    assert {branches(window) for window in WINDOWS} == {branches(WINDOWS[-1])}


@given(window=st.integers(0, len(WINDOWS) - 1), batch=st.integers(1, 2),
       height=st.integers(1, 40), width=st.integers(1, 45), seed=st.integers(0, 2 ** 16))
@settings(max_examples=40, deadline=None)
def test_max_pool_matches_onnxruntime_at_any_map_size(compiled_windows, window, batch, height,
                                                      width, seed):
    """Maps narrower than a vector, than a vector plus the window, and wide ones, so that each
    row has scalar columns only, vectors and a shifted last vector, serial and parallel."""
    kernel, _, pads, _ = WINDOWS[window]
    assume(height + pads[0] + pads[2] >= kernel[0] and width + pads[1] + pads[3] >= kernel[1])
    feeds = {"x": np.random.default_rng(seed).standard_normal((batch, 3, height, width))
             .astype(np.float32)}
    compiled = compiled_windows[window]
    expected = run_onnxruntime(compiled["model"], feeds)["y"]
    for side in THRESHOLDS:
        np.testing.assert_array_equal(compiled[side].run(feeds)["y"], expected,
                                      err_msg=f"{side}, window {WINDOWS[window]}")


def test_dilated_max_pool_keeps_the_fallback_schedule():
    model = max_pool_model((2, 2), (1, 1), (0, 0, 0, 0), 0, dilations=(2, 2))
    assert "window_max" not in scheduled_kernel(model, "max_pool")
    feeds = {"x": np.random.default_rng(2).standard_normal((1, 3, 9, 11)).astype(np.float32)}
    np.testing.assert_array_equal(tightfit.compile(model).session().run(feeds)["y"],
                                  run_onnxruntime(model, feeds)["y"])


def test_a_max_pool_fused_with_its_consumer_keeps_the_fallback_schedule():
    """MaxPool then Relu fuse into one kernel: the pool kernel would drop the Relu."""
    nodes = [helper.make_node("MaxPool", ["x"], ["pooled"], kernel_shape=(2, 2), strides=(2, 2)),
             helper.make_node("Relu", ["pooled"], ["y"])]
    graph = helper.make_graph(
        nodes, "max_pool_relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3, "oh", "ow"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert "window_max" not in scheduled_kernel(model, "max_pool")
    feeds = {"x": np.random.default_rng(3).standard_normal((1, 3, 10, 12)).astype(np.float32)}
    np.testing.assert_array_equal(tightfit.compile(model).session().run(feeds)["y"],
                                  run_onnxruntime(model, feeds)["y"])


def test_max_pool_compiles_for_arm64_neon_in_four_lane_vectors():
    arm64 = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]}
    model = max_pool_model(*WINDOWS[1])
    kernel = scheduled_kernel(model, "max_pool", target=arm64)
    assert "window_max" in kernel and "T.Ramp(T.int64(0), T.int64(1), 4)" in kernel
    assert tightfit.compile(model, target=arm64).executable is not None
