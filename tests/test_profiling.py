"""The kernel profile names the kernels a run calls, with plausible times, and leaves the session as it was."""

import json

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import tightfit
from tightfit.cli import main


def test_profile_times_every_kernel_call_of_a_run(mlp_package):
    session = mlp_package.session()
    x = np.random.default_rng(0).standard_normal((6, 8)).astype(np.float32)
    expected = session.run({"x": x})["y"]
    profile = session.profile({"x": x})
    names = [kernel.name for kernel in profile.kernels]
    assert len(names) == len(set(names)) >= 2  # two matmuls (one with the bias and relu fused)
    assert all(kernel.calls >= 1 and 0 < kernel.seconds < profile.run_seconds for kernel in profile.kernels)
    # in whole runs each kernel takes part of the run that timed it, and all of them less than it
    assert all(0 < kernel.in_run_seconds for kernel in profile.kernels)
    assert profile.in_run_kernel_seconds < profile.instrumented_run_seconds
    assert [kernel.in_run_seconds for kernel in profile.kernels] == sorted(
        (kernel.in_run_seconds for kernel in profile.kernels), reverse=True)
    assert any((6, 8) in kernel.argument_shapes for kernel in profile.kernels)
    assert "whole run" in profile.table()
    np.testing.assert_array_equal(session.run({"x": x})["y"], expected)


def test_run_profile_on_the_command_line(mlp_path, capsys):
    assert main(["run", mlp_path, "--shape", "x=3,8", "--profile", "--json"]) == 0
    profile = json.loads(capsys.readouterr().out)["profile"]
    assert profile["run_seconds"] > 0 and profile["instrumented_run_seconds"] > 0
    assert all(kernel["in_run_seconds"] > 0 for kernel in profile["kernels"])
    assert sum(kernel["calls"] for kernel in profile["kernels"]) >= 2


def test_layers_that_share_one_kernel_keep_a_row_each():
    rng = np.random.default_rng(0)
    layers = 3  # equal widths: one compiled kernel, called three times
    nodes, weights = [], []
    for layer in range(layers):
        weights.append(numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), f"w{layer}"))
        nodes += [helper.make_node("MatMul", [f"h{layer}", f"w{layer}"], [f"m{layer}"]),
                  helper.make_node("Relu", [f"m{layer}"], [f"h{layer + 1}"])]
    graph = helper.make_graph(nodes, "repeated_layers",
                              [helper.make_tensor_value_info("h0", TensorProto.FLOAT, ["batch", 16])],
                              [helper.make_tensor_value_info(f"h{layers}", TensorProto.FLOAT, ["batch", 16])],
                              weights)
    package = tightfit.compile(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    profile = package.session().profile({"h0": rng.standard_normal((4, 16)).astype(np.float32)})
    layer_calls = [kernel for kernel in profile.kernels if "dense" in kernel.name]
    assert len({kernel.name for kernel in layer_calls}) == 1
    assert sorted((kernel.call, kernel.calls) for kernel in layer_calls) == [(1, 3), (2, 3), (3, 3)]
    assert all(kernel.seconds > 0 and kernel.in_run_seconds > 0 for kernel in layer_calls)
    assert profile.table().count(f" {layer_calls[0].name} (") == layers
