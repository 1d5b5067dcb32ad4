"""The kernel profile names the kernels a run calls, with plausible times, and leaves the session as it was."""

import json

import numpy as np

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
