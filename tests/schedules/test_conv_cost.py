"""Where the conv cost model picks the direct kernel (conv_cost.DIRECT_EFFICIENCY_BY_CHANNELS)."""

import dataclasses

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tightfit.frontend import import_onnx
from tightfit.pipeline import run_pipeline
from tightfit.schedules.conv_cost import ConvShape, Rates, candidate_costs, choose
from tightfit.schedules.isa import AVX512
from tightfit.target import resolve_target

from kernel_harness import selected_algorithms


def conv3x3(channels, size, out_channels, stride) -> ConvShape:
    return ConvShape(1, channels, size, size, out_channels, (3, 3), (stride, stride), (1, 1),
                     (1, 1, 1, 1), 1)


# measured alone on the AVX-512 host, 2 threads (`tightfit search`), direct / width kernel
@pytest.mark.parametrize("shape, expected", [
    (conv3x3(64, 56, 128, 2), "direct"),  # ResNet's downsampling: 914 / 1330 us
    (conv3x3(128, 28, 256, 2), "direct"),  # 842 / 1348 us
    (conv3x3(48, 24, 96, 2), "direct"),  # 105 / 175 us
    (conv3x3(3, 224, 32, 2), "width_vectors"),  # MobileNetV2's stem: 325 / 200 us
    (conv3x3(12, 16, 24, 1), "width_vectors"),  # conv_dynamic_hw's: 40 / 21 us
    (conv3x3(8, 32, 8, 1), "width_vectors"),  # 32 / 17 us
])
def test_direct_conv_is_chosen_over_many_channels_where_it_measured_faster(shape, expected):
    assert choose(candidate_costs(shape, AVX512, Rates.for_target(AVX512, 2, None)),
                  None).name == expected


def test_filters_of_fewer_taps_keep_the_direct_kernel_slower():
    """1x3 convs over 32-40 channels measured direct 1.0-1.2x the width kernel's time, so the
    many-channel rate is not theirs."""
    rates = Rates.for_target(AVX512, 2, None)
    shape = ConvShape(1, 40, 1, 40, 32, (1, 3), (1, 2), (1, 1), (0, 1, 0, 1), 1)
    costs = {c.name: c.seconds for c in candidate_costs(shape, AVX512, rates)}
    assert costs["direct"] > costs["width_vectors"]


def test_the_pass_runs_a_downsampling_conv_over_many_channels_as_the_direct_kernel():
    """SelectConvAlgorithm over a batch-symbolic ResNet stride-2 conv (costed at a typical
    batch) picks the direct kernel."""
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((128, 64, 3, 3)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1], strides=[2, 2])], "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64, 56, 56])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 128, 28, 28])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    selected, _ = run_pipeline(import_onnx(model).mod, resolve_target("host"),
                               stop_after="tightfit.SelectConvAlgorithm")
    assert selected_algorithms(selected) == ["direct"]


def test_over_a_symbolic_plane_the_direct_kernel_keeps_its_old_rate():
    """The fitted rate was measured over static planes; over a symbolic one a narrow map runs
    the direct kernel's one-pixel version (ResNet-18's 512-channel convs at 4x4: 2.3 ms each,
    846 us over a static plane), so the same conv costs more there."""
    rates = Rates.for_target(AVX512, 2, None)
    static = conv3x3(512, 4, 512, 1)
    symbolic = dataclasses.replace(static, static_plane=False)
    costs = {shape.static_plane: {c.name: c.seconds for c in candidate_costs(shape, AVX512, rates)}
             for shape in (static, symbolic)}
    assert costs[False]["direct"] > costs[True]["direct"]
    assert costs[False]["width_vectors"] == costs[True]["width_vectors"]


def test_winograd_pays_for_reading_its_larger_weights_each_run():
    """Winograd F(m, 3) reads (m + 2)^2 / 9 times a 3x3 filter's weights every run. ResNet-18's
    512 -> 512 convs ran Winograd F(2,3) in ~1000-1078 us inside a run, reading 16.8 MB of
    transformed weights, and now run direct over 9.4 MB. At 2x2, where F(2,3) wins clearly
    without the term (the model costs them at 1x1, the typical extent's plane, where it was a
    tie), the weight reads tip it; on a 56x56 map of 64 channels Winograd's saved multiply-adds
    still outweigh its 0.6 MB."""
    rates = Rates.for_target(AVX512, 2, None)
    late = dataclasses.replace(conv3x3(512, 2, 512, 1), static_plane=False)
    costs = {c.name: c for c in candidate_costs(late, AVX512, rates)}
    assert costs["winograd_f2"].weight_bytes == 16 * 512 * 512 * 4
    assert costs["direct"].weight_bytes == 9 * 512 * 512 * 4
    assert choose(list(costs.values()), None).name == "direct"
    assert choose(candidate_costs(conv3x3(64, 56, 64, 1), AVX512, rates), None).name.startswith(
        "winograd")
