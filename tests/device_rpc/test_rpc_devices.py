"""Devices over RPC without the emulator: presets, targets, clear errors, tuning on a local x86 server."""

import json
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tightfit.cli import main
from tightfit.device_rpc.devices import load_device, preset_names
from tightfit.device_rpc.emulated import SERVER_LOOP
from tightfit.device_rpc.tracker import devices_under, free_port, stop_process_group, wait_for_key
from tightfit.device_rpc.tuning import recorded_trials
from tightfit.errors import DeviceError, TargetError
from tightfit.target import resolve_target

pytestmark = pytest.mark.xdist_group("rpc_devices")  # see test_emulated_arm64.py

SERVER_WITHOUT_TORCH = "from tightfit.fresh_process import forbid_torch; forbid_torch()\n" + SERVER_LOOP


@pytest.fixture(scope="module")
def x86_server(tracker):
    """A plain TVM RPC server on this machine, registered under the key 'x86-local': TVM's listen
    loop, each session forked from it, as `python -m tvm.exec.rpc_server` runs them. It runs the
    loop in the process it starts (emulated.SERVER_LOOP) and without torch: `tvm.exec.rpc_server`
    imported TVM, and torch with it, in two processes (26 s of this module's setup in CI)."""
    port = free_port(9300)
    server = subprocess.Popen([sys.executable, "-c", SERVER_WITHOUT_TORCH, "127.0.0.1", str(port), "x86-local",
                               tracker.host, str(tracker.port), ""], start_new_session=True)
    wait_for_key(tracker, "x86-local", minimum=1, timeout_s=60, alive=lambda: server.poll() is None)
    yield "x86-local"
    stop_process_group(server.pid)


def test_device_tests_stay_on_one_pytest_worker(request):
    """Under `make test` (pytest-xdist, --dist loadgroup) xdist marks every device test with its
    group; a pytest that drops the mark (pytest-dev/pytest-xdist#1386) would spread the device
    tests over the workers, where they stop each other's devices."""
    if not request.config.getoption("loadgroup", False):
        pytest.skip("not run by pytest-xdist with --dist loadgroup")
    assert request.node.nodeid.endswith("@rpc_devices")


def test_every_preset_is_a_valid_arm64_target():
    assert {"emulated-arm64", "raspberry-pi-5", "pixel-8"} <= set(preset_names())
    for name in preset_names():
        device = load_device(name)
        target = resolve_target(name)
        assert target.name == name and not target.runs_on_host
        assert "aarch64" in str(target.tvm_target.attrs["mtriple"])
        assert target.num_threads == device.target["num-cores"]
        assert sum(cluster.count for cluster in device.clusters) >= target.num_threads


def test_unknown_device_names_the_presets():
    with pytest.raises(TargetError, match="presets are .*emulated-arm64"):
        resolve_target("nokia-3310")


def test_unreachable_tracker_fails_fast_and_says_what_to_do(capsys):
    port = free_port(9400)
    started = time.monotonic()
    assert main(["devices", "--rpc-tracker", f"127.0.0.1:{port}"]) == DeviceError.exit_code
    assert time.monotonic() - started < 10
    assert "no RPC tracker answers" in capsys.readouterr().err


def test_key_without_device_fails_fast(tracker, tmp_path, mlp_path, capsys):
    started = time.monotonic()
    code = main(["run", mlp_path, "--shape", "x=2,8", "--rpc-tracker", str(tracker), "--rpc-key", "no-such-phone"])
    assert code == DeviceError.exit_code and time.monotonic() - started < 30
    assert "no device under key 'no-such-phone'" in capsys.readouterr().err


def test_devices_lists_the_trackers_keys(tracker, x86_server, capsys):
    assert main(["devices", "--rpc-tracker", str(tracker), "--json"]) == 0
    keys = {entry["key"]: entry for entry in json.loads(capsys.readouterr().out)["tracker"]["keys"]}
    assert keys[x86_server]["total"] == 1


def test_tuning_on_a_local_x86_server_fills_the_database_and_compile_uses_it(tracker, x86_server, tmp_path,
                                                                          mlp_path, capsys):
    database = tmp_path / "db"
    tune = ["tune", mlp_path, "--shape", "x=8,8", "--rpc-tracker", str(tracker), "--rpc-key", x86_server,
            "--db", str(database), "--json"]
    assert main([*tune, "--trials", "4"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["measured"] + report["failed"] == 4 and recorded_trials(database) == 4
    assert main([*tune, "--trials", "4"]) == 0  # nothing left to measure
    assert json.loads(capsys.readouterr().out)["measured"] == 0 and recorded_trials(database) == 4
    package = tmp_path / "tuned.tfpkg"
    assert main(["compile", mlp_path, "--shape", "x=8,8", "--db", str(database), "-o", str(package)]) == 0
    assert main(["run", str(package), "--check"]) == 0


def test_dynamic_inputs_must_be_fixed_for_tuning(tracker, x86_server, tmp_path, mlp_path, capsys):
    code = main(["tune", mlp_path, "--rpc-tracker", str(tracker), "--rpc-key", x86_server, "--db", str(tmp_path)])
    assert code != 0 and "--shape NAME=DIMS" in capsys.readouterr().err


def test_remote_run_on_the_x86_server_matches_onnxruntime(tracker, x86_server, mlp_path, capsys):
    assert main(["run", mlp_path, "--shape", "x=3,8", "--rpc-tracker", str(tracker), "--rpc-key", x86_server,
                 "--check"]) == 0
    assert "ok" in capsys.readouterr().out
    assert devices_under(tracker, x86_server) == 1


def test_search_on_the_x86_server_times_conv_algorithms_and_tiles_there(tracker, x86_server, tmp_path, capsys):
    """`tightfit search` over RPC: the conv's candidates, the kernels' register tiles and the
    parallel threshold are all timed on the device (each kernel's library uploaded into one
    session); compile then reads the database."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3], pads=[1] * 4)], "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, "h", "w"])],
        [numpy_helper.from_array((rng.standard_normal((16, 8, 3, 3)) * 0.2).astype(np.float32), "w")])
    model_path, knobs = tmp_path / "conv.onnx", tmp_path / "knobs.json"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(model_path))
    assert main(["search", str(model_path), "--shapes", "x=1,8,12,20", "--knobs", str(knobs), "--tiles", "2",
                 "--rpc-tracker", str(tracker), "--rpc-key", x86_server, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (conv,) = report["convs"]
    assert len(conv["measured_us"]) == 5 and all(us > 0 for us in conv["measured_us"].values())
    assert report["tiles"] and all(row["tried"] == 2 and row["us"] > 0 for row in report["tiles"])
    assert report["min_parallel_work"] >= 1
    package = tmp_path / "conv.tfpkg"
    assert main(["compile", str(model_path), "--knobs", str(knobs), "-o", str(package)]) == 0
    assert main(["run", str(package), "--shape", "x=1,8,9,30", "--check"]) == 0
