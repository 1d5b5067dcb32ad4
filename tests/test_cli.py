"""The `tightfit` command as scripts use it: exit codes, one-line errors, JSON output."""

import json
import subprocess
import sys

import numpy as np
import pytest


def tightfit(*args, check_rc=None):
    completed = subprocess.run([sys.executable, "-m", "tightfit.cli", *map(str, args)],
                               capture_output=True, text=True, timeout=300)
    if check_rc is not None:
        assert completed.returncode == check_rc, completed.stderr
    return completed


@pytest.mark.parametrize("command", ["compile", "run", "bench", "inspect", "conformance"])
def test_every_subcommand_has_help(command):
    result = tightfit(command, "--help", check_rc=0)
    assert "usage: tightfit " + command in result.stdout


def test_compile_then_run_with_check_against_onnxruntime(mlp_path, tmp_path):
    package = tmp_path / "mlp.tfpkg"
    compiled = tightfit("compile", mlp_path, "-o", package, "--json", check_rc=0)
    assert json.loads(compiled.stdout)["package"] == str(package)
    ran = tightfit("run", package, "--reference", mlp_path, "--shape", "x=6,8", "--check",
                   "--json", check_rc=0)
    report = json.loads(ran.stdout)
    assert report["check"]["ok"] and report["check"]["max_abs_error"] < 1e-4
    assert report["outputs"]["y"]["shape"] == [6, 4]


def test_run_uses_given_inputs_and_saves_outputs(mlp_path, tmp_path):
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    tightfit("run", mlp_path, "--inputs", tmp_path / "in.npz", "--save-outputs",
             tmp_path / "out.npz", check_rc=0)
    from tightfit.feeds import run_onnxruntime

    with np.load(tmp_path / "out.npz") as outputs:
        np.testing.assert_allclose(outputs["y"], run_onnxruntime(mlp_path, {"x": x})["y"],
                                   rtol=1e-4, atol=1e-4)


def test_errors_are_one_line_with_a_specific_exit_code(tmp_path, mlp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not an onnx file")
    result = tightfit("compile", bad)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and result.stderr.startswith("error: ")
    assert "Traceback" not in result.stderr
    verbose = tightfit("compile", bad, "--verbose")
    assert "Traceback" in verbose.stderr
    dynamic = tightfit("run", mlp_path)
    assert dynamic.returncode == 5 and "--shape x=batch,8" in dynamic.stderr


def test_unsupported_operator_names_node_and_op(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    node = helper.make_node("MyCustomOp", ["x"], ["y"], name="mystery", domain="com.example")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.example", 1)])
    onnx.save(model, str(tmp_path / "custom.onnx"))
    result = tightfit("compile", tmp_path / "custom.onnx", "-o", tmp_path / "custom.tfpkg")
    assert result.returncode == 3
    assert "MyCustomOp" in result.stderr and "mystery" in result.stderr
    assert not (tmp_path / "custom.tfpkg").exists()


def test_inspect_lists_pipeline_and_ops_with_symbolic_shapes(mlp_path):
    report = json.loads(tightfit("inspect", mlp_path, "--json", check_rc=0).stdout)
    assert [row["op"] for row in report["ops"]] == ["matmul", "add", "nn.relu", "matmul"]
    assert report["ops"][0]["output"] == "(batch, 16)"
    assert any(row["pass"] == "FuseOps" for row in report["pipeline"])
