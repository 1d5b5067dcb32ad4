"""The emulated Arm64 device: a zoo model compiled for Arm64 runs on it; a tuning session on it is
killed with the device and resumes without losing records.

The first run sets the device up (Debian packages, an aarch64 sysroot and TVM's aarch64 runtime
wheel, ~3 minutes; cached in ~/.cache/tightfit afterwards).
"""

import dataclasses
import functools
import json
import os
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tightfit
from tightfit.cli import main
from tightfit.device_rpc import emulated
from tightfit.device_rpc.tracker import devices_under
from tightfit.device_rpc.tuning import recorded_trials
from tightfit.errors import DeviceError, TargetError
from tightfit.feeds import max_abs_error, run_onnxruntime
from tightfit.testing import zoo

# one pytest worker runs every device test: they share the RPC tracker's port range and the
# emulated device's key
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("rpc_devices")]
# A key of this test process's own. A run killed before its teardown leaves its server running,
# and that server registers again with whatever tracker later takes the same port: under a shared
# key it would be counted and handed out as this run's device.
KEY_PREFIX = "emulated-arm64-test-"
KEY = f"{KEY_PREFIX}{os.getpid()}"


@pytest.fixture(scope="module")
def arm64_device(tracker):
    stop_servers_of_ended_runs()
    emulated.start(KEY, tracker)
    yield KEY
    emulated.stop(KEY)


def stop_servers_of_ended_runs() -> list[str]:
    """Stop the servers that test processes no longer running started; returns their keys."""
    stopped = []
    for server in emulated.running():
        owner = server.key.removeprefix(KEY_PREFIX)
        if server.key.startswith(KEY_PREFIX) and owner.isdigit() and not _process_exists(int(owner)):
            emulated.stop(server.key)
            stopped.append(server.key)
    return stopped


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def test_zoo_model_compiled_for_arm64_runs_on_the_emulated_device(tracker, arm64_device, tmp_path):
    entry = zoo.get("conv_dynamic_hw")
    model = entry.build()
    package_path = tightfit.compile(model, "emulated-arm64").save(tmp_path / "model.tfpkg")
    package = tightfit.load(package_path)
    with pytest.raises(TargetError, match="compiled for emulated-arm64"):
        package.session()  # an aarch64 library: not for this machine
    session = package.remote_session(str(tracker), arm64_device)
    # one package serves every shape, on the device too; 16 x 6 makes the second conv's output
    # narrower than a NEON vector (the kernel's narrow version)
    for shapes in [*entry.shape_sets[:2], {"image": (1, 3, 16, 6)}]:
        feeds = {name: np.random.default_rng(0).standard_normal(shape).astype(np.float32)
                 for name, shape in shapes.items()}
        outputs = session.run(feeds)
        assert max_abs_error(outputs, run_onnxruntime(model, feeds)) < 1e-4
    assert len(session.time_run(feeds, repeat=2)) == 2


@pytest.mark.parametrize("algorithm", ["winograd_f2", "winograd_f4"])
def test_winograd_conv_compiled_for_arm64_runs_on_the_emulated_device(tracker, arm64_device,
                                                                      algorithm):
    """Winograd's transforms vectorize over channels in NEON's 4 lanes; 9 x 11 leaves partial
    tiles at the bottom and the right."""
    rng = np.random.default_rng(3)
    weight = numpy_helper.from_array((rng.standard_normal((32, 16, 3, 3)) * 0.2)
                                     .astype(np.float32), "w")
    bias = numpy_helper.from_array(rng.standard_normal(32).astype(np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3], pads=[1] * 4),
         helper.make_node("Relu", ["c"], ["y"])], "winograd_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32, "h", "w"])],
        [weight, bias])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = tightfit.PipelineOptions(conv_algorithms=(algorithm,))
    session = tightfit.compile(model, "emulated-arm64", options=options).remote_session(
        str(tracker), arm64_device)
    feeds = {"x": rng.standard_normal((1, 16, 9, 11)).astype(np.float32)}
    assert max_abs_error(session.run(feeds), run_onnxruntime(model, feeds)) < 1e-4


@pytest.mark.parametrize("stride", [1, 2])
def test_depthwise_conv_compiled_for_arm64_runs_on_the_emulated_device(tracker, arm64_device,
                                                                       stride):
    """The depthwise kernel's packing in NEON vectors (padding.py: 4-lane copies, and for
    stride 2 two loads deinterleaved by shuffles) and its edge columns, at widths of a few
    vectors plus a remainder, and narrower than a vector (masked row stores, row_chunks.py)."""
    rng = np.random.default_rng(4)
    weight = numpy_helper.from_array(rng.standard_normal((12, 1, 3, 3)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3], pads=[1] * 4,
                          group=12, strides=[stride, stride])], "depthwise_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 12, "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 12, None, None])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = tightfit.compile(model, "emulated-arm64").remote_session(str(tracker), arm64_device)
    for width in (3, 5, 23, 41):
        feeds = {"x": rng.standard_normal((1, 12, 7, width)).astype(np.float32)}
        assert max_abs_error(session.run(feeds), run_onnxruntime(model, feeds)) < 1e-4


@pytest.mark.parametrize("groups, kernel, stride, algorithm", [
    (4, 3, 1, "width_vectors"),  # ResNeXt-style: NEON tiles of a group's 4 channels
    (1, 3, 2, "im2col"),  # the unfolding kernel, then the pointwise GEMM in 4-lane vectors
    (1, 1, 2, "im2col"),  # a strided shortcut, where the model picks im2col
], ids=["grouped", "im2col_3x3", "im2col_1x1_strided"])
def test_grouped_and_im2col_convs_compiled_for_arm64_run_on_the_emulated_device(
        tracker, arm64_device, groups, kernel, stride, algorithm):
    rng = np.random.default_rng(5)
    weight = numpy_helper.from_array((rng.standard_normal((16, 16 // groups, kernel, kernel)) * 0.2)
                                     .astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[kernel, kernel],
                          pads=[kernel // 2] * 4, group=groups, strides=[stride, stride])],
        "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, None, None])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = tightfit.PipelineOptions(conv_algorithms=(algorithm,))
    session = tightfit.compile(model, "emulated-arm64", options=options).remote_session(
        str(tracker), arm64_device)
    for width in (3, 9, 23):
        feeds = {"x": rng.standard_normal((1, 16, 7, width)).astype(np.float32)}
        assert max_abs_error(session.run(feeds), run_onnxruntime(model, feeds)) < 1e-4


def test_channel_vector_pointwise_conv_compiled_for_arm64_runs_on_the_emulated_device(
        tracker, arm64_device):
    """A pointwise conv over CHANNEL_VECTORS_MIN_CHANNELS channels: NEON tiles of one
    16-channel panel (four vectors) x 6 pixels, with prefetches; planes under a tile (one
    pixel at a time), at a tile, and over it with a shifted tail."""
    from tightfit.schedules.conv2d import CHANNEL_VECTORS_MIN_CHANNELS

    rng = np.random.default_rng(6)
    channels = CHANNEL_VECTORS_MIN_CHANNELS
    weight = numpy_helper.from_array((rng.standard_normal((32, channels, 1, 1)) * 0.1)
                                     .astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[1, 1])], "pointwise",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32, None, None])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = tightfit.compile(model, "emulated-arm64").remote_session(str(tracker), arm64_device)
    for height, width in ((1, 5), (2, 3), (7, 7), (5, 4)):
        feeds = {"x": rng.standard_normal((1, channels, height, width)).astype(np.float32)}
        assert max_abs_error(session.run(feeds), run_onnxruntime(model, feeds)) < 1e-4


@pytest.mark.parametrize("channels, out_channels, kernel, stride, algorithm", [
    (128, 128, 1, 1, "width_vectors"),  # pointwise: 64 KiB of weights, prefetched per panel row
    (64, 32, 3, 2, "direct"),  # direct: 72 KiB, prefetched along the reduction
], ids=["pointwise", "direct"])
def test_weight_prefetching_convs_compiled_for_arm64_run_on_the_emulated_device(
        tracker, arm64_device, channels, out_channels, kernel, stride, algorithm):
    """Convs whose packed weights reach PREFETCH_MIN_WEIGHT_BYTES ask for their weight rows
    ahead (schedules/prefetch.py); with NEON's 4-lane panels the prefetched addresses run past
    the last panel at the end of a reduction, which the device must not fault on. Widths under,
    at and past a tile."""
    from tightfit.schedules.prefetch import PREFETCH_MIN_WEIGHT_BYTES

    rng = np.random.default_rng(8)
    weight = (rng.standard_normal((out_channels, channels, kernel, kernel)) * 0.1).astype(np.float32)
    assert weight.nbytes >= PREFETCH_MIN_WEIGHT_BYTES
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[kernel, kernel],
                          pads=[kernel // 2] * 4, strides=[stride, stride]),
         helper.make_node("Relu", ["c"], ["y"])], "prefetching_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, out_channels, None, None])],
        [numpy_helper.from_array(weight, "w"),
         numpy_helper.from_array(rng.standard_normal(out_channels).astype(np.float32), "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = tightfit.PipelineOptions(conv_algorithms=(algorithm,))
    session = tightfit.compile(model, "emulated-arm64", options=options).remote_session(
        str(tracker), arm64_device)
    for height, width in ((1, 3), (4, 6), (5, 13)):
        feeds = {"x": rng.standard_normal((1, channels, height, width)).astype(np.float32)}
        assert max_abs_error(session.run(feeds), run_onnxruntime(model, feeds)) < 1e-4


def test_pool_and_row_kernels_compiled_for_arm64_run_on_the_emulated_device(tracker,
                                                                            arm64_device):
    """A ResNet stem's max pool (3x3, stride 2, pad 1: two 4-lane loads deinterleaved per tap
    group, scalar edge columns) and a softmax over its rows (rows in groups; a row under a
    vector in chunks and single elements, wider ones ending in a vector shifted back to the
    row's end), at widths under a vector, of a few vectors, and with a shifted last one."""
    graph = helper.make_graph(
        [helper.make_node("MaxPool", ["x"], ["pooled"], kernel_shape=[3, 3], strides=[2, 2],
                          pads=[1] * 4),
         helper.make_node("Softmax", ["pooled"], ["scores"], axis=-1)], "pool_softmax",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, "h", "w"])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 3, None, None])
         for name in ("pooled", "scores")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = tightfit.compile(model, "emulated-arm64").remote_session(str(tracker), arm64_device)
    rng = np.random.default_rng(7)
    for height, width in ((5, 5), (9, 23), (4, 41)):
        feeds = {"x": rng.standard_normal((1, 3, height, width)).astype(np.float32)}
        assert max_abs_error(session.run(feeds), run_onnxruntime(model, feeds)) < 1e-5


def test_kernel_choices_timed_on_the_emulated_device_decide_the_arm64_build(tracker, arm64_device,
                                                                            tmp_path, capsys):
    """`tightfit search` over RPC: every candidate of a strided conv and the chosen kernel's
    NEON tiles compiled for Arm64, timed on the device in one RPC session, recorded under the
    Arm64 target; the Arm64 build then runs the candidate measured fastest there, and matches
    onnxruntime on the device."""
    rng = np.random.default_rng(7)
    weight = numpy_helper.from_array((rng.standard_normal((16, 8, 3, 3)) * 0.2).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3], pads=[1] * 4, strides=[2, 2])],
        "strided_conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, None, None])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model_path, knobs = tmp_path / "conv.onnx", tmp_path / "knobs.json"
    onnx.save(model, str(model_path))
    assert main(["search", str(model_path), "--target", "emulated-arm64", "--shapes", "x=1,8,24,20",
                 "--tiles", "1", "--knobs", str(knobs), "--rpc-tracker", str(tracker),
                 "--rpc-key", arm64_device, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (conv,) = report["convs"]
    assert report["tiles"] and report["min_parallel_work"] >= 1
    assert set(conv["measured_us"]) == {"direct", "width_vectors", "im2col"}
    assert all(us > 0 for us in conv["measured_us"].values())
    (target_key,) = json.loads(knobs.read_text())["targets"]
    assert "aarch64" in target_key
    stages = {}
    package = tightfit.compile(model, "emulated-arm64", options=tightfit.PipelineOptions(knob_database=str(knobs)),
                               after_pass=stages.setdefault)
    chosen = stages["tightfit.SelectConvAlgorithm"]
    (algorithm,) = [str(func.attrs["tightfit.algorithm"]) for func in chosen.functions.values()
                    if func.attrs is not None and "tightfit.algorithm" in func.attrs
                    and "tightfit.conv_key" in func.attrs]
    assert algorithm == conv["measured_choice"]
    session = package.remote_session(str(tracker), arm64_device)
    feeds = {"x": rng.standard_normal((1, 8, 15, 21)).astype(np.float32)}
    assert max_abs_error(session.run(feeds), run_onnxruntime(model, feeds)) < 1e-4


@pytest.mark.parametrize("build, kernel", [
    (functools.partial(zoo.transformer_encoder, dynamo=True, heads=4), "attention"),
    (functools.partial(zoo.transformer_encoder, dynamo=True, heads=2), "matmul_packed_rhs"),
    (zoo.bert_encoder, "attention")], ids=["fused-attention", "gemm-attention", "bert-masked"])
def test_transformer_compiled_for_arm64_runs_on_the_emulated_device(tracker, arm64_device, build,
                                                                   kernel):
    """Two-layer encoders of width 32: heads of 8 run as one attention kernel (queries in
    NEON's 4 lanes, their tiles transposed by shuffles, Q, K and V read from the QKV
    projection at a stride of 96 per row; in bert_encoder from three projections, with its
    padding mask added), heads of 16 as the GEMM kernels (K^T packed from K, the head merge
    done by the PV product's stores); dense layers, layer norm, softmax and GELU in 4-lane
    vectors too. Sequences under, at and past one and two query tiles."""
    model = build()
    stages = {}
    package = tightfit.compile(model, "emulated-arm64", after_pass=stages.setdefault)
    names = [global_var.name_hint for global_var in stages["tightfit.FallbackCPUSchedule"].functions]
    assert any(name.startswith(kernel) for name in names), names
    session = package.remote_session(str(tracker), arm64_device)
    for batch, sequence in ((1, 1), (2, 3), (1, 4), (2, 5), (1, 8), (3, 9)):
        # token ids, and a padding mask for the model that takes one
        feeds = zoo.get("bert_encoder").feeds({"tokens": (batch, sequence)})
        feeds = {value.name: feeds[value.name] for value in model.graph.input}
        assert max_abs_error(session.run(feeds), run_onnxruntime(model, feeds)) < 1e-4, (batch, sequence)


def _tune_command(model_path, tracker, database, trials):
    return [sys.executable, "-m", "tightfit.cli", "tune", str(model_path), "--target", "emulated-arm64",
            "--shape", "x=8,8", "--rpc-tracker", str(tracker), "--rpc-key", KEY, "--trials", str(trials),
            "--db", str(database), "--session-timeout", "20", "--batch", "2", "--json"]


def _distinct_candidates(database) -> int:
    import tvm
    import tvm_ffi
    from tvm.s_tir import meta_schedule as ms

    hashes = set()
    for record in ms.database.JSONDatabase(work_dir=str(database)).get_all_tuning_records():
        schedule = tvm.s_tir.Schedule(record.workload.mod)
        record.trace.apply_to_schedule(schedule, remove_postproc=False)
        hashes.add(tvm_ffi.structural_hash(schedule.mod))
    return len(hashes)


def test_tuning_killed_with_its_device_resumes_without_losing_records(tracker, arm64_device, tmp_path, mlp_model):
    model_path = tmp_path / "mlp.onnx"
    onnx.save(mlp_model, str(model_path))
    database = tmp_path / "db"
    tuning = subprocess.Popen(_tune_command(model_path, tracker, database, 6),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while recorded_trials(database) < 2 and tuning.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert tuning.poll() is None, f"tuning ended before the device was killed: {tuning.communicate()}"
    emulated.stop(KEY)  # the device dies mid-session
    _, errors = tuning.communicate(timeout=300)
    assert tuning.returncode == DeviceError.exit_code, errors
    assert f"the device under '{KEY}' is gone" in errors and "run the same command again" in errors
    kept = recorded_trials(database)
    assert 2 <= kept < 6

    emulated.start(KEY, tracker)
    assert devices_under(tracker, KEY) == 1
    resumed = subprocess.run(_tune_command(model_path, tracker, database, 6),
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    report = json.loads(resumed.stdout)
    assert report["recorded_before"] == kept
    assert recorded_trials(database) == 6  # nothing lost, nothing measured twice
    assert _distinct_candidates(database) == 6


def test_starting_a_second_device_under_the_key_keeps_the_first(tracker, arm64_device, tmp_path, mlp_path, capsys):
    first = emulated.running(KEY)
    assert main(["device", "emulate", "--key", KEY, "--rpc-tracker", str(tracker), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["devices_under_key"] == len(first) + 1
    assert devices_under(tracker, KEY) == len(first) + 1
    assert all(server.alive() for server in first)
    package = tmp_path / "mlp.tfpkg"
    assert main(["compile", mlp_path, "--target", "emulated-arm64", "-o", str(package)]) == 0
    for _ in range(2):  # the tracker hands out either device
        assert main(["run", str(package), "--shape", "x=2,8", "--rpc-tracker", str(tracker),
                     "--rpc-key", KEY, "--check"]) == 0
    assert main(["device", "emulate", "--key", KEY, "--rpc-tracker", str(tracker), "--stop"]) == 0
    assert emulated.running(KEY) == []
    deadline = time.monotonic() + 30  # the tracker notices when a server's connection closes
    while devices_under(tracker, KEY) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert devices_under(tracker, KEY) == 0


def test_a_server_whose_test_run_was_killed_is_stopped_by_the_next_run(tmp_path, monkeypatch):
    monkeypatch.setenv("TIGHTFIT_CACHE", str(tmp_path))  # a state folder of this test's own
    ended_run = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                               capture_output=True, text=True, check=True)
    orphan_key = f"{KEY_PREFIX}{int(ended_run.stdout)}"
    # stand-ins for servers, in their own process groups as emulated.start launches them
    orphan = subprocess.Popen(["sleep", "600"], start_new_session=True)
    ours = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        for key, process, port in [(orphan_key, orphan, 9090), (KEY, ours, 9091)]:
            server = emulated.EmulatedServer(key, process.pid, port, "127.0.0.1:9290", "", 0.0)
            (emulated.cache_dir() / "servers").mkdir(parents=True, exist_ok=True)
            (emulated.cache_dir() / "servers" / f"{key}-{port}.json").write_text(
                json.dumps(dataclasses.asdict(server)))
        assert stop_servers_of_ended_runs() == [orphan_key]
        assert orphan.wait(timeout=10) is not None
        assert ours.poll() is None
        assert [server.key for server in emulated.running()] == [KEY]
    finally:
        for process in (orphan, ours):
            process.kill()
            process.wait()
