"""The packed-weight file: format, dedup, zero-copy mapping, sharing, invalidation, atomicity."""

import json
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import onnx
import pytest

import tightfit
from tightfit.errors import CorruptPackageError, PackageError, StalePackageError
from tightfit.session import device_tensor
from tightfit.weight_file import MAGIC, WeightFile, WeightTensor, write_weight_file

PROVENANCE = {"tightfit_version": "test", "tvm_version": "test", "target": {"name": "host"}}


def test_round_trip_keeps_order_values_keys_and_page_alignment(tmp_path):
    rng = np.random.default_rng(0)
    tensors = [WeightTensor("a", rng.standard_normal((3, 5)).astype(np.float32), "key-a"),
               WeightTensor("scalar", np.array(2.5, np.float32), "key-s"),
               WeightTensor("ids", np.arange(7, dtype=np.int64), "key-i")]
    stats = write_weight_file(tmp_path / "w.tfw", tensors, PROVENANCE)
    assert stats.blobs == 3 and stats.dedup_saved_bytes == 0
    assert (tmp_path / "w.tfw").read_bytes()[:8] == MAGIC
    opened = WeightFile(tmp_path / "w.tfw", expect=PROVENANCE, verify=True)
    assert opened.names == ["a", "scalar", "ids"]
    for tensor, (name, value) in zip(tensors, opened.arrays().items()):
        assert value.shape == tensor.value.shape and value.dtype == tensor.value.dtype
        np.testing.assert_array_equal(value, tensor.value)
    assert all(blob["offset"] % opened.header["page_size"] == 0 for blob in opened.header["blobs"])


def test_equal_weights_are_stored_once(tmp_path):
    shared = np.ones((64, 64), np.float32)
    tensors = [WeightTensor("embed", shared, "k1"), WeightTensor("lm_head", shared.copy(), "k2"),
               WeightTensor("other", np.zeros((64, 64), np.float32), "k3")]
    stats = write_weight_file(tmp_path / "w.tfw", tensors, PROVENANCE)
    assert stats.blobs == 2 and stats.dedup_saved_bytes == shared.nbytes
    opened = WeightFile(tmp_path / "w.tfw")
    arrays = opened.arrays()
    assert np.shares_memory(arrays["embed"], arrays["lm_head"])
    assert opened.header["blobs"][0]["keys"] == ["k1", "k2"]


def test_mapped_weights_reach_tvm_without_a_copy(tmp_path):
    write_weight_file(tmp_path / "w.tfw", [WeightTensor("w", np.arange(4096, dtype=np.float32), "k")],
                      PROVENANCE)
    view = WeightFile(tmp_path / "w.tfw").arrays()["w"]
    import tvm

    tensor = device_tensor(view, tvm.cpu())
    assert np.from_dlpack(tensor).ctypes.data == view.ctypes.data


def test_stale_provenance_and_corrupt_blobs_are_detected(tmp_path):
    path = tmp_path / "w.tfw"
    write_weight_file(path, [WeightTensor("w", np.arange(2048, dtype=np.float32), "k")], PROVENANCE)
    with pytest.raises(StalePackageError, match="tvm_version is 'test', expected 'other'"):
        WeightFile(path, expect={**PROVENANCE, "tvm_version": "other"})
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    WeightFile(path)  # structure intact: only hashing finds it
    with pytest.raises(CorruptPackageError, match="blob 0 \\(w\\) does not match its hash"):
        WeightFile(path, verify=True)
    path.write_bytes(b"NOTAFILE" + bytes(data[8:]))
    with pytest.raises(CorruptPackageError, match="bad magic"):
        WeightFile(path)


def gemm_model(scale: float = 1.0) -> onnx.ModelProto:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((96, 128)) * scale).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w"], ["y"], transB=1, name="fc")], "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 128])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 96])],
        [numpy_helper.from_array(weight, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def unpacked_dense_weight(stored: np.ndarray, out_features: int) -> np.ndarray:
    """The [N, K] weight back from the GEMM kernel's panels [ceil(N / NB), K, NB]."""
    panels, in_features, panel_width = stored.shape
    return stored.transpose(0, 2, 1).reshape(panels * panel_width, in_features)[:out_features]


def test_weight_transforms_run_at_compile_time_and_are_stored(tmp_path):
    package = tightfit.compile(gemm_model())
    (stored,) = package.weights
    weight = onnx.numpy_helper.to_array(gemm_model().graph.initializer[0])
    assert stored.value.ndim == 3  # transB and panel packing done once, offline
    np.testing.assert_array_equal(unpacked_dense_weight(stored.value, 96), weight)
    package.save(tmp_path / "g.tfpkg")
    x = np.random.default_rng(1).standard_normal((3, 128)).astype(np.float32)
    expected = x @ onnx.numpy_helper.to_array(gemm_model().graph.initializer[0]).T
    out = tightfit.load(tmp_path / "g.tfpkg").session().run({"x": x})["y"]
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


def saved_from_file(tmp_path, model):
    source = tmp_path / "model.onnx"
    onnx.save(model, str(source))
    return source, tightfit.compile(source).save(tmp_path / "model.tfpkg")


def test_changed_source_model_is_detected_and_rebuilt(tmp_path):
    source, package_path = saved_from_file(tmp_path, gemm_model(scale=1.0))
    onnx.save(gemm_model(scale=3.0), str(source))
    with pytest.warns(UserWarning, match="source .* has changed"):
        rebuilt = tightfit.load(package_path)
    np.testing.assert_allclose(unpacked_dense_weight(rebuilt.weights[0].value, 96),
                               onnx.numpy_helper.to_array(gemm_model(scale=3.0).graph.initializer[0]))


def test_package_from_another_version_is_rebuilt_or_refused(tmp_path):
    source, package_path = saved_from_file(tmp_path, gemm_model())
    manifest_path = package_path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["tvm_version"] = "0.1.0"
    manifest_path.write_text(json.dumps(manifest))
    with pytest.warns(UserWarning, match="tvm_version is '0.1.0'"):
        tightfit.load(package_path)
    assert json.loads(manifest_path.read_text())["tvm_version"] != "0.1.0"
    manifest_path.write_text(json.dumps(manifest))
    source.unlink()
    with pytest.raises(PackageError, match="no source model at hand"):
        tightfit.load(package_path)


def test_corrupt_weights_are_never_used(tmp_path):
    source, package_path = saved_from_file(tmp_path, gemm_model())
    weights = package_path / "weights.tfw"
    data = bytearray(weights.read_bytes())
    data[-8] ^= 0x40
    weights.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="does not match its hash"):
        repaired = tightfit.load(package_path, verify=True)
    np.testing.assert_array_equal(unpacked_dense_weight(repaired.weights[0].value, 96),
                                  onnx.numpy_helper.to_array(gemm_model().graph.initializer[0]))
    weights.write_bytes(bytes(data))
    source.unlink()
    with pytest.raises(PackageError, match="does not match its hash"):
        tightfit.load(package_path, verify=True)


SHARING_PROBE = textwrap.dedent("""
    import sys
    from tightfit.weight_file import WeightFile
    path = sys.argv[1]
    arrays = WeightFile(path).arrays()
    total = sum(float(a.sum()) for a in arrays.values())  # touch every page
    print("ready", flush=True)
    sys.stdin.readline()
    rss = pss = 0
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            if "-" in line.split()[0] and len(line.split()) >= 5:
                inside = line.rstrip().endswith(path)
            elif inside and line.startswith("Rss:"):
                rss += int(line.split()[1])
            elif inside and line.startswith("Pss:"):
                pss += int(line.split()[1])
    print(rss, pss, flush=True)
    sys.stdin.readline()  # stay mapped until every probe has measured
""")


def test_two_processes_share_the_physical_pages_of_the_weights(tmp_path):
    path = tmp_path / "big.tfw"
    write_weight_file(path, [WeightTensor("w", np.ones((4096, 1024), np.float32), "k")], PROVENANCE)
    probes = []
    for _ in range(2):
        probe = subprocess.Popen([sys.executable, "-c", SHARING_PROBE, str(path)], text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert probe.stdout.readline().strip() == "ready"
        probes.append(probe)
    for probe in probes:  # both measure while both still map the file
        probe.stdin.write("\n")
        probe.stdin.flush()
    results = [tuple(map(int, probe.stdout.readline().split())) for probe in probes]
    for probe in probes:
        probe.communicate("\n", timeout=60)
    for rss_kib, pss_kib in results:
        assert rss_kib >= 16 * 1024  # the 16 MiB blob is resident in each process
        assert pss_kib <= 0.6 * rss_kib  # ...but each is charged about half: the pages are shared


CONCURRENT_WRITER = textwrap.dedent("""
    import sys, tightfit
    from tightfit.fresh_process import forbid_torch
    forbid_torch()  # 4-5 s of each writer's start, which compiles an ONNX file only
    for _ in range(3):
        tightfit.compile(sys.argv[1]).save(sys.argv[2])
""")


def test_concurrent_builds_leave_one_complete_package(tmp_path):
    source = tmp_path / "model.onnx"
    onnx.save(gemm_model(), str(source))
    destination = tmp_path / "model.tfpkg"
    writers = [subprocess.Popen([sys.executable, "-c", CONCURRENT_WRITER, str(source), str(destination)])
               for _ in range(2)]
    assert all(writer.wait(timeout=300) == 0 for writer in writers)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.tfpkg.lock", "model.onnx", "model.tfpkg"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a rebuild would mean the package was not complete
        package = tightfit.load(destination, verify=True)
    assert package.session().run({"x": np.ones((1, 128), np.float32)})["y"].shape == (1, 96)


def test_duplicated_weights_of_a_model_are_stored_once(tmp_path):
    from onnx import TensorProto, helper, numpy_helper

    # Exporters often write a weight shared by two layers as two identical initializers.
    shared = np.random.default_rng(0).standard_normal((128, 128)).astype(np.float32) / 8
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "layer0.weight"], ["h"]),
         helper.make_node("Relu", ["h"], ["a"]),
         helper.make_node("MatMul", ["a", "layer1.weight"], ["y"])], "shared",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 128])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 128])],
        [numpy_helper.from_array(shared, "layer0.weight"), numpy_helper.from_array(shared.copy(), "layer1.weight")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    package = tightfit.compile(model)
    package.save(tmp_path / "shared.tfpkg")
    assert package.report["weight_file"]["dedup_saved_bytes"] == shared.nbytes
    assert package.report["weight_file"]["blobs"] == 1
    x = np.random.default_rng(1).standard_normal((3, 128)).astype(np.float32)
    out = tightfit.load(tmp_path / "shared.tfpkg").session().run({"x": x})["y"]
    np.testing.assert_allclose(out, np.maximum(x @ shared, 0) @ shared, rtol=1e-4, atol=1e-4)
