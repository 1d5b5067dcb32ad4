"""Which kernels run on one thread: a kernel's loop work counts a register-tiled
multiply-accumulate at 1/MAC_WORK_DIVISOR per MAC (dispatch.py), and the threshold it is
compared with is measured on the target (knob_search.calibrate_min_parallel_work)."""

import math

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from tvm import s_tir, tirx

import tightfit
from tightfit.feeds import run_onnxruntime
from tightfit.frontend import import_onnx
from tightfit.pipeline import PipelineOptions, run_pipeline
from tightfit.schedules import conv2d, schedule_kernels
from tightfit.schedules.dispatch import MAC_WORK_DIVISOR, loop_work
from tightfit.schedules.fallback_cpu import has_root_block
from tightfit.schedules.knob_search import calibrate_min_parallel_work
from tightfit.schedules.register_tile import KERNEL_ANNOTATION
from tightfit.schedules.schedule_kernels import MAC_KERNELS, find_kernel_block
from tightfit.schedules.tail_tiles import rewrite_loop_nest
from tightfit.target import resolve_target

from kernel_harness import threshold_database

CHANNELS, OUT_CHANNELS, SIZE = 12, 24, 16
MACS = OUT_CHANNELS * SIZE * SIZE * CHANNELS * 9


def conv_model(height=SIZE, width=SIZE):
    """A 12 -> 24 channel 3x3 conv, as conv_dynamic_hw's second, over a static 16x16 image
    unless the height and width are given (dim names for symbolic ones)."""
    rng = np.random.default_rng(4)
    weight = rng.standard_normal((OUT_CHANNELS, CHANNELS, 3, 3)).astype(np.float32) * 0.2
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])],
        "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, CHANNELS, height, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, OUT_CHANNELS, height, width])],
        [numpy_helper.from_array(weight, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def knob_database(tmp_path, threshold: int) -> str:
    return threshold_database(tmp_path / f"threshold_{threshold}.json", threshold)


def conv_kernel_before_scheduling() -> s_tir.Schedule:
    mod, _ = run_pipeline(import_onnx(conv_model()).mod, resolve_target("host"),
                          PipelineOptions(), stop_after="DeadCodeElimination")
    found = [s_tir.Schedule(func) for func in mod.functions.values()
             if isinstance(func, tirx.PrimFunc) and has_root_block(func)]
    found = [sch for sch in found if find_kernel_block(sch) is not None]
    assert len(found) == 1
    return found[0]


def test_a_register_tiled_convs_macs_count_a_fraction_of_its_loop_work():
    kernel = conv_kernel_before_scheduling()
    assert str(find_kernel_block(kernel)[1][KERNEL_ANNOTATION]) in MAC_KERNELS
    unweighted, weighted = int(loop_work(kernel)), int(loop_work(kernel, MAC_KERNELS))
    assert unweighted - weighted == MACS - MACS // MAC_WORK_DIVISOR


@pytest.mark.parametrize("side", ["below", "above"])
def test_a_conv_runs_serially_exactly_when_its_weighted_work_is_below_the_threshold(tmp_path, side):
    kernel = conv_kernel_before_scheduling()
    unweighted, weighted = int(loop_work(kernel)), int(loop_work(kernel, MAC_KERNELS))
    # between the two counts, only the weighting can send the kernel to one thread
    threshold = (weighted + unweighted) // 2 if side == "below" else weighted
    options = PipelineOptions(knob_database=knob_database(tmp_path, threshold))
    scheduled, _ = run_pipeline(import_onnx(conv_model()).mod, resolve_target("host"),
                                options, stop_after="tightfit.FallbackCPUSchedule")
    kernel = next(func.script() for global_var, func in scheduled.functions.items()
                  if isinstance(func, tirx.PrimFunc) and "conv2d" in global_var.name_hint)
    assert ("T.parallel" in kernel) == (side == "above")

    model = conv_model()
    image = np.random.default_rng(5).standard_normal((1, CHANNELS, SIZE, SIZE))
    feeds = {"x": image.astype(np.float32)}
    ours = tightfit.compile(model, options=options).session().run(feeds)
    np.testing.assert_allclose(ours["y"], run_onnxruntime(model, feeds)["y"], rtol=1e-4, atol=1e-5)


def test_each_serial_version_is_its_parallel_twin_with_serial_loops(monkeypatch):
    # over a symbolic image the work may fall either side of the threshold: each row version
    # comes parallel, then serial, joined in that order; only the parallel one is scheduled,
    # the serial one is made from it (dispatch.serial_twin)
    schedules = []
    for module, name in [(schedule_kernels, "schedule_register_tiles"),
                         (conv2d, "schedule_width_vectors"), (conv2d, "schedule_depthwise")]:
        def counted(*args, schedule=getattr(module, name), **kwargs):
            schedules.append(args)
            return schedule(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)
    scheduled, _ = run_pipeline(import_onnx(conv_model("height", "width")).mod,
                                resolve_target("host"), PipelineOptions(),
                                stop_after="tightfit.FallbackCPUSchedule")
    kernel, = (func for global_var, func in scheduled.functions.items()
               if isinstance(func, tirx.PrimFunc) and "conv2d" in global_var.name_hint)
    loop_kinds: dict[str, list] = {}

    def note_version(realize):
        if realize.block.name_hint.startswith("version_"):
            kinds = loop_kinds[realize.block.name_hint] = []
            rewrite_loop_nest(realize.block.body, lambda inner: inner,
                              on_enter_for=lambda loop: kinds.append(loop.kind))
        return realize

    rewrite_loop_nest(kernel.body, note_version)
    versions = [loop_kinds[f"version_{index}"] for index in range(len(loop_kinds))]
    assert len(versions) >= 4 and len(versions) % 2 == 0
    assert len(schedules) == len(versions) // 2
    for parallel, serial in zip(versions[::2], versions[1::2]):
        assert tirx.ForKind.PARALLEL in parallel
        assert serial == [tirx.ForKind.SERIAL if kind == tirx.ForKind.PARALLEL else kind
                          for kind in parallel]


def test_the_calibrated_threshold_is_a_power_of_two_within_the_measured_range():
    threshold = calibrate_min_parallel_work(resolve_target("host"))
    assert 1 << 12 <= threshold <= 1 << 22
    assert math.log2(threshold).is_integer()
