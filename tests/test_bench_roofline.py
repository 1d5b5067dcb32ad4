"""The roofline report: FLOPs counted right, layers cut out faithfully, ceiling kernels that do
the work they are timed for, and the CLI writing its table and plot."""

import json
import subprocess
import sys

import numpy as np
import onnxruntime
import tvm
from onnx import TensorProto, helper, numpy_helper

from tightfit.bench_roofline import (FMA_CHAINS, _intermediate_values, fma_chains_kernel,
                                     largest_layers, layer_flops, stream_scale_kernel)
from tightfit.feeds import random_feeds
from tightfit.frontend import declared_inputs
from tightfit.target import resolve_target
from tightfit.testing import zoo


def test_flops_are_two_per_multiply_add_for_conv_depthwise_matmul_and_gemm():
    resnet_conv = helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])
    assert layer_flops(resnet_conv, {"x": (1, 64, 56, 56), "w": (64, 64, 3, 3),
                                     "y": (1, 64, 56, 56)}) == 231_211_008
    depthwise = helper.make_node("Conv", ["x", "w"], ["y"], group=64, strides=[2, 2])
    assert layer_flops(depthwise, {"x": (2, 64, 96, 80), "w": (64, 1, 3, 3),
                                   "y": (2, 64, 48, 40)}) == 2 * 2 * 64 * 48 * 40 * 9
    batched = helper.make_node("MatMul", ["q", "k"], ["s"])
    assert layer_flops(batched, {"q": (2, 4, 33, 8), "k": (2, 4, 8, 33),
                                 "s": (2, 4, 33, 33)}) == 2 * 2 * 4 * 33 * 33 * 8
    gemm = helper.make_node("Gemm", ["a", "b"], ["c"], transA=1)
    assert layer_flops(gemm, {"a": (16, 2), "b": (16, 10), "c": (2, 10)}) == 2 * 2 * 10 * 16


def test_cut_out_layers_are_the_largest_and_give_the_values_the_model_gives_them():
    entry = zoo.get("mobilenet_v2_style")
    proto = entry.build()
    feeds = random_feeds(declared_inputs(proto.graph), {"image": (2, 3, 96, 80)})
    conv, gemm = largest_layers("mobilenet_v2_style", proto, feeds)
    # 16 -> 64 1x1 on 48x40 maps: more multiply-adds than the stem, depthwise or classifier
    assert conv.description.startswith("Conv block0.expand")
    assert conv.flops == 2 * 2 * 64 * 48 * 40 * 16
    assert gemm.description.startswith("Gemm classifier") and gemm.flops == 2 * 2 * 10 * 16
    for layer in (conv, gemm):
        output = layer.model.graph.output[0].name
        in_model = _intermediate_values(proto, feeds, {output})[output]
        alone = onnxruntime.InferenceSession(layer.model.SerializeToString(),
                                             providers=["CPUExecutionProvider"])
        # onnxruntime fuses the whole model's nodes differently: the sums may round apart
        np.testing.assert_allclose(alone.run(None, layer.feeds)[0], in_model, rtol=1e-5, atol=1e-4)
        weights = set(layer.model.graph.node[0].input[1:])
        assert weights <= {t.name for t in layer.model.graph.initializer}


def test_a_weight_from_a_constant_node_stays_a_weight():
    weight = np.arange(12, dtype=np.float32).reshape(4, 3)
    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["w"], value=numpy_helper.from_array(weight)),
         helper.make_node("Relu", ["x"], ["r"]),
         helper.make_node("MatMul", ["r", "w"], ["y"], name="project")], "constant_weight",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.linspace(-1, 1, 20, dtype=np.float32).reshape(5, 4)
    [layer] = largest_layers("constant_weight", proto, {"x": x})
    assert list(layer.feeds) == ["r"] and layer.feeds["r"].shape == (5, 4)
    np.testing.assert_array_equal(numpy_helper.to_array(layer.model.graph.initializer[0]), weight)
    assert layer.min_bytes == (20 + 12 + 15) * 4


def test_ceiling_kernels_compute_what_they_are_timed_for():
    target = resolve_target("host").tvm_target
    threads, lanes, iterations = 2, 16, 7
    seeds = np.random.default_rng(0).random((threads, FMA_CHAINS, lanes)).astype(np.float32)
    results = tvm.runtime.tensor(np.zeros_like(seeds))
    tvm.compile(fma_chains_kernel(threads, lanes), target)(tvm.runtime.tensor(seeds), results,
                                                             iterations)
    expected = seeds
    for _ in range(iterations):
        expected = expected * np.float32(0.999) + np.float32(0.001)
    np.testing.assert_allclose(results.numpy(), expected, rtol=1e-6)

    elements = threads * lanes * 5
    source = np.random.default_rng(1).random(elements).astype(np.float32)
    destination = tvm.runtime.tensor(np.zeros(elements, np.float32))
    tvm.compile(stream_scale_kernel(threads, lanes, elements), target)(
        tvm.runtime.tensor(source), destination)
    np.testing.assert_array_equal(destination.numpy(), 2 * source)


def test_cli_roofline_writes_table_json_and_plot(tmp_path):
    completed = subprocess.run(
        [sys.executable, "-m", "tightfit.cli", "bench", "--roofline", "--zoo", "conv_dynamic_hw",
         "--repeat", "2", "--out", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout)
    assert report["ceilings"]["peak_gflops"] > report["ceilings"]["bandwidth_gbs"] > 0
    [layer] = report["layers"]  # conv_dynamic_hw has convs and no GEMM
    assert layer["description"].startswith("Conv ")
    assert set(layer["median_ms"]) == {"tightfit", "onnxruntime", "tvm-default"}
    assert layer["max_abs_error"] < 1e-4
    assert "| 1 | conv_dynamic_hw | Conv " in (tmp_path / "roofline.md").read_text()
    assert (tmp_path / "roofline.png").read_bytes().startswith(b"\x89PNG")


def test_roofline_of_a_dynamic_model_file_asks_for_its_shapes(mlp_path, capsys):
    from tightfit.cli import main

    assert main(["bench", mlp_path, "--roofline"]) == 5
    assert "--shapes x=batch,8" in capsys.readouterr().err
