"""The row kernels (schedules/row_kernels.py), softmax and layer norm, match onnxruntime at every
row width."""

import subprocess
import sys

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import tightfit
from tightfit.feeds import run_onnxruntime
from tightfit.frontend import import_onnx
from tightfit.pipeline import PipelineOptions, run_pipeline
from tightfit.schedules.isa import isa_for_target
from tightfit.schedules.row_kernels import ROW_ACCUMULATORS, ROW_GROUP
from tightfit.target import resolve_target

from conftest import THRESHOLDS
from kernel_harness import threshold_database


def softmax_model(axis: int) -> onnx.ModelProto:
    """Softmax over x[n, 3, s, s], as attention's scores (scaled first, so the kernel is alone);
    3 heads, so that the row count leaves each remainder after whole groups of ROW_GROUP rows."""
    nodes = [helper.make_node("Mul", ["x", "scale"], ["scaled"]),
             helper.make_node("Softmax", ["scaled"], ["y"], axis=axis)]
    graph = helper.make_graph(
        nodes, "scores_softmax",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, "s", "s"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3, "s", "s"])],
        [helper.make_tensor("scale", TensorProto.FLOAT, [], [0.7])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def compiled_sessions(tmp_path_factory) -> dict:
    """The last-axis model, and a session of it compiled for each side of the work `if`."""
    model = softmax_model(-1)
    directory = tmp_path_factory.mktemp("knobs")
    sessions = {side: tightfit.compile(model, options=PipelineOptions(
        knob_database=threshold_database(directory / f"{side}.json", threshold))).session()
        for side, threshold in THRESHOLDS.items()}
    return {"model": model, **sessions}


def scheduled_kernel(model, name: str, knob_database=None, target="host") -> str:
    """The TVMScript of `model`'s scheduled PrimFunc whose name holds `name`."""
    scheduled, _ = run_pipeline(import_onnx(model).mod, resolve_target(target),
                                PipelineOptions(knob_database=knob_database),
                                stop_after="tightfit.FallbackCPUSchedule")
    return next(func.script() for global_var, func in scheduled.functions.items()
                if name in global_var.name_hint)


def scheduled_softmax(model, knob_database=None, target="host") -> str:
    return scheduled_kernel(model, "softmax", knob_database, target)


def test_last_axis_softmax_runs_row_by_row_without_a_temporary(knob_database):
    """The row kernel replaces TOPI's four loop nests: no buffer of exponentials as large as the
    input, and the row's maximum and sum folded in registers."""
    kernel = scheduled_softmax(softmax_model(-1), knob_database)
    assert "row_maximum" in kernel and "row_reciprocal" in kernel
    assert "T_fast_exp" not in kernel and "sblock_alloc_buffer" not in kernel


def test_row_kernels_take_rows_in_groups_stage_by_stage(knob_database):
    """ROW_GROUP rows per iteration, every row's maximum folded before any row's sum is (the
    rows' dependent chains side by side), then the rows left one at a time."""
    kernel = scheduled_softmax(softmax_model(-1), knob_database)
    grouped, rest = kernel.split("for row in", 1)
    assert f"row_group * T.int64({ROW_GROUP}) + T.int64({ROW_GROUP - 1})" in grouped
    maxima = [grouped.index(f"row_maximum{f'_{row}' if row else ''}: ") for row in range(ROW_GROUP)]
    assert max(maxima) < grouped.index("row_reciprocal: ")
    single = rest.split("else:")[0]
    assert "row_maximum: " in single and "row_maximum_1: " not in single


def test_softmax_over_another_axis_keeps_the_fallback_schedule(knob_database):
    model = softmax_model(1)
    assert "T_fast_exp" in scheduled_softmax(model, knob_database)
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 3, 3, 3)).astype(np.float32)}
    np.testing.assert_allclose(tightfit.compile(model).session().run(feeds)["y"],
                               run_onnxruntime(model, feeds)["y"], rtol=1e-4, atol=1e-6)


@given(batch=st.integers(1, 3), sequence=st.integers(1, 70), spread=st.sampled_from([1.0, 60.0]),
       data=st.data())
@settings(max_examples=25, deadline=None)
def test_row_softmax_matches_onnxruntime_at_any_width(compiled_sessions, batch, sequence, spread,
                                                      data):
    """Every width from 1 to past four vectors (each chunk size and leftover count), row counts
    with each remainder after the groups of rows, serial and parallel; `spread` 60 drives
    exp(x - max) of most scores below float32's range."""
    seed = data.draw(st.integers(0, 2 ** 16))
    x = (np.random.default_rng(seed).standard_normal((batch, 3, sequence, sequence)) * spread)
    feeds = {"x": x.astype(np.float32)}
    expected = run_onnxruntime(compiled_sessions["model"], feeds)["y"]
    for name in ("serial", "parallel"):
        np.testing.assert_allclose(compiled_sessions[name].run(feeds)["y"], expected, rtol=1e-4,
                                   atol=1e-6, err_msg=f"{name} at {batch}x{sequence}")


def test_row_softmax_matches_onnxruntime_at_the_vector_edges(compiled_sessions):
    """Symbolic widths around whole vectors of this host's ISA: a row narrower than a vector
    (chunks, or one masked vector where masks are fast), exactly one, one past it and one short of two (a vector shifted back to the row's
    end, masked to the lanes left), serial and parallel; the maximum in the shifted vector's
    masked lanes in one row, in its fresh lanes in another. A sum that took an overlapped lane
    twice, or a fresh one not at all, would miss onnxruntime's values by far more than the
    tolerance."""
    lanes = isa_for_target(resolve_target("host").tvm_target).lanes
    rng = np.random.default_rng(11)
    for width in (lanes - 1, lanes, lanes + 1, 2 * lanes - 1, 3 * lanes + 2):
        x = rng.standard_normal((2, 3, width, width)) * 4
        x[0, 0, 0, width - lanes] += 30  # masked lane of the shifted vector (a covered column)
        x[0, 0, 1, width - 1] += 30      # its last, fresh lane
        feeds = {"x": x.astype(np.float32)}
        expected = run_onnxruntime(compiled_sessions["model"], feeds)["y"]
        for name in ("serial", "parallel"):
            np.testing.assert_allclose(compiled_sessions[name].run(feeds)["y"], expected,
                                       rtol=1e-4, atol=1e-6, err_msg=f"{name} at width {width}")


def test_row_softmax_compiles_for_arm64_neon_in_four_lane_chunks():
    arm64 = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]}
    kernel = scheduled_softmax(softmax_model(-1), target=arm64)
    assert "row_maximum" in kernel and "T.Ramp(T.int64(0), T.int64(1), 4)" in kernel
    assert "T.int64(1), 8)" not in kernel
    assert tightfit.compile(softmax_model(-1), target=arm64).executable is not None


def layer_norm_model(width: int, axis: int = -1) -> onnx.ModelProto:
    """LayerNormalization of x[n, s, width] (epsilon 1e-3, not the default, so that a kernel
    that ignored it would fail), as a transformer's, with random gamma and beta."""
    rng = np.random.default_rng(width)
    normalized = [width] if axis == -1 else [3, width]
    shape = ["n", "s" if axis == -1 else 3, width]
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["y"], axis=axis,
                              epsilon=1e-3)]
    graph = helper.make_graph(
        nodes, "layer_norm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        [numpy_helper.from_array(rng.standard_normal(normalized).astype(np.float32), "gamma"),
         numpy_helper.from_array(rng.standard_normal(normalized).astype(np.float32), "beta")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_last_axis_layer_norm_runs_row_by_row_without_temporaries(knob_database):
    kernel = scheduled_kernel(layer_norm_model(32), "layer_norm", knob_database)
    assert "row_mean" in kernel and "row_inverse_deviation" in kernel
    assert "sblock_alloc_buffer" not in kernel and "0.0010000000474974513" in kernel


def test_rows_of_a_known_width_accumulate_in_several_vectors():
    """A 256-wide layer norm sums into ROW_ACCUMULATORS vectors; a softmax over a sequence, of
    symbolic width, into one."""
    lanes = isa_for_target(resolve_target("host").tvm_target).lanes
    assert f"row_total = T.alloc_buffer(({ROW_ACCUMULATORS * lanes},))" in scheduled_kernel(
        layer_norm_model(256), "layer_norm")
    assert f"row_total = T.alloc_buffer(({lanes},))" in scheduled_softmax(softmax_model(-1))


@pytest.mark.parametrize("classes", [1000, 1003])
def test_softmax_over_classes_folds_its_accumulators_to_onnxruntime_s_values(classes):
    """A classifier's softmax over 1000 classes (a known width: several accumulators for the
    maximum and the sum), rows of logits far apart, so that a wrong fold of the maxima would
    overflow or lose every row's mass; over 1003, the row also ends in a shifted vector after
    the accumulators' groups and the whole vectors left."""
    graph = helper.make_graph(
        [helper.make_node("Softmax", ["x"], ["y"], axis=-1)], "classes_softmax",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", classes])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", classes])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = tightfit.compile(model).session()
    rng = np.random.default_rng(5)
    x = rng.standard_normal((7, classes)) * 20 + rng.uniform(-500, 500, (7, 1))
    x[:, 997] += 200  # the maximum in the last vector's slot of a row
    feeds = {"x": x.astype(np.float32)}
    np.testing.assert_allclose(session.run(feeds)["y"], run_onnxruntime(model, feeds)["y"],
                               rtol=1e-4, atol=1e-6)


def test_layer_norm_over_two_axes_keeps_the_fallback_schedule():
    model = layer_norm_model(8, axis=-2)
    assert "row_mean" not in scheduled_kernel(model, "layer_norm")
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 3, 8)).astype(np.float32)}
    np.testing.assert_allclose(tightfit.compile(model).session().run(feeds)["y"],
                               run_onnxruntime(model, feeds)["y"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("width", [1, 5, 16, 37, 64])
def test_row_layer_norm_matches_onnxruntime_at_vector_edges(knob_database, width):
    """Widths below, at and past a vector and an odd one (each chunk size and leftover count),
    serial and parallel, over rows of symbolic count; one input has a mean of 100 and a
    standard deviation of 1, where the variance as a difference of squares would cancel (x^2
    near 1e4 carries float32 errors near 1e-3 of the variance)."""
    model = layer_norm_model(width)
    options = PipelineOptions(knob_database=knob_database)
    session = tightfit.compile(model, options=options).session()
    rng = np.random.default_rng(width)
    for batch, sequence, mean in [(1, 1, 0.0), (2, 7, 0.0), (3, 33, 100.0)]:
        feeds = {"x": (rng.standard_normal((batch, sequence, width)) + mean).astype(np.float32)}
        np.testing.assert_allclose(session.run(feeds)["y"], run_onnxruntime(model, feeds)["y"],
                                   rtol=1e-4, atol=2e-4, err_msg=f"{batch}x{sequence}")


def test_narrow_rows_of_a_symbolic_width_are_one_masked_vector_where_masks_are_fast():
    """AVX-512 (fast masks) moves a row narrower than a vector as one masked vector; AVX2, whose
    masked moves are slow on AMD Zen, keeps its chunks."""
    avx512 = scheduled_softmax(softmax_model(-1), target={"kind": "llvm", "mcpu": "skylake-avx512"})
    avx2 = scheduled_softmax(softmax_model(-1), target={"kind": "llvm", "mcpu": "haswell"})
    assert 'T.masked_load("float32x16"' in avx512 and "T.masked_store(" in avx512
    assert "masked" not in avx2


# An input that ends where an unreadable page begins: a masked vector that loaded a lane past
# the row's end would fault (numerically, a masked-out lane read changes nothing). Softmax: the
# last row of x ends there; layer norm over a symbolic width: gamma, a row of its own, does.
GUARD_PAGE_RUN = """
import ctypes, mmap, sys
import numpy as np
from onnx import TensorProto, helper
import tightfit
from tightfit.fresh_process import forbid_torch
forbid_torch()  # 4-5 s of the process's start, which runs an ONNX model only
from tightfit.feeds import run_onnxruntime

op, width, rows = sys.argv[1], int(sys.argv[2]), 3
inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "w"])]
if op == "softmax":
    node = helper.make_node("Softmax", ["x"], ["y"], axis=-1)
else:
    node = helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["y"], axis=-1)
    inputs += [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["w"])
               for name in ("gamma", "beta")]
model = helper.make_model(helper.make_graph(
    [node], op, inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "w"])]),
    opset_imports=[helper.make_opsetid("", 17)])
session = tightfit.compile(model).session()


def ending_at_a_guard_page(count):
    page = mmap.PAGESIZE
    memory = mmap.mmap(-1, 2 * page)
    start = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mprotect(ctypes.c_void_p(start + page), page, 0) == 0  # PROT_NONE
    return np.frombuffer(memory, np.float32, count, offset=page - count * 4)


rng = np.random.default_rng(width)
if op == "softmax":
    feeds = {"x": ending_at_a_guard_page(rows * width).reshape(rows, width)}
else:
    feeds = {"x": np.empty((rows, width), np.float32), "gamma": ending_at_a_guard_page(width),
             "beta": np.empty(width, np.float32)}
for array in feeds.values():
    array[...] = rng.standard_normal(array.shape)
np.testing.assert_allclose(session.run(feeds)["y"], run_onnxruntime(model, feeds)["y"],
                           rtol=1e-5, atol=1e-5)
"""


@pytest.mark.parametrize("op, width", [("softmax", 1), ("softmax", 5), ("softmax", 16),
                                       ("layer_norm", 5), ("layer_norm", 17)])
def test_narrow_rows_read_nothing_past_the_input(op, width):
    """Rows of a symbolic `width` whose input ends at an unreadable page, read in place (the
    session views its inputs), match onnxruntime; each case runs in a process of its own so
    that a fault fails only this test. At width 5 (one masked vector on AVX-512) the rows, and
    a layer norm's gamma, are read masked; at 17 whole vectors end at the row's end."""
    run = subprocess.run([sys.executable, "-c", GUARD_PAGE_RUN, op, str(width)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
