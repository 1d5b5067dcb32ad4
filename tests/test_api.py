"""The Python API: compile, save, load and run, one package serving every dynamic shape."""

import numpy as np
import onnx
import pytest

import tightfit
from tightfit.errors import InputError, ModelLoadError, PackageError
from tightfit.feeds import run_onnxruntime


def test_convnet_matches_onnxruntime_at_several_shapes_with_one_package(convnet_model, tmp_path):
    package = tightfit.compile(convnet_model)
    package.save(tmp_path / "convnet.tfpkg")
    session = tightfit.load(tmp_path / "convnet.tfpkg").session()
    rng = np.random.default_rng(1)
    for shape in [(1, 3, 32, 32), (3, 3, 40, 56), (2, 3, 17, 23)]:
        image = rng.standard_normal(shape).astype(np.float32)
        outputs = session.run({"image": image})
        expected = run_onnxruntime(convnet_model, {"image": image})
        np.testing.assert_allclose(outputs["logits"], expected["logits"], rtol=1e-4, atol=1e-4)


def test_compile_accepts_a_path_and_dumps_ir_after_every_pass_in_order(mlp_path, tmp_path):
    seen = []
    tightfit.compile(mlp_path, dump_ir=tmp_path / "ir", on_pass=seen.append)
    dumped = sorted(p.name for p in (tmp_path / "ir").iterdir())
    assert dumped[0] == "00-imported.py"
    assert seen[-1] == "build"  # on_pass reports code generation after the passes
    assert [name.split("-", 1)[1].removesuffix(".py") for name in dumped[1:]] == seen[:-1]
    assert "R.function" in (tmp_path / "ir" / dumped[-1]).read_text()


def test_input_shapes_option_fixes_a_dynamic_dim(mlp_model):
    package = tightfit.compile(mlp_model, input_shapes={"x": [3, 8]})
    assert package.inputs[0].shape == (3, 8)
    with pytest.raises(InputError, match="axis 0 is fixed at 3"):
        package.session().run({"x": np.zeros((2, 8), np.float32)})


def test_kernel_argument_checks_are_kept_only_when_asked_for(mlp_model):
    """Without the checks (the default) the kernels hold no error messages; with them a kernel
    called with a wrongly shaped tensor names the argument; both builds compute the same."""
    import re

    import tvm

    x = np.random.default_rng(2).standard_normal((5, 8)).astype(np.float32)
    outputs = {}
    for checks in (False, True):
        package = tightfit.compile(mlp_model, options=tightfit.PipelineOptions(kernel_argument_checks=checks))
        outputs[checks] = package.session().run({"x": x})["y"]
        library = package.executable.mod.imports[0]
        code = library.inspect_source("ll")
        assert ("when calling" in code) == checks
    np.testing.assert_array_equal(outputs[False], outputs[True])
    kernel = next(name for name in re.findall(r"define [^@]*@__tvm_ffi_(\w+)\(", code)
                  if name.startswith("dense"))
    wrong = [tvm.runtime.tensor(np.zeros((2, 2), np.float32)) for _ in range(3)]
    with pytest.raises(ValueError, match=f"when calling:\\s+`{kernel}"):
        library[kernel](*wrong)


def test_saved_package_round_trips_weights_and_specs(mlp_package, tmp_path):
    mlp_package.save(tmp_path / "m.tfpkg")
    loaded = tightfit.load(tmp_path / "m.tfpkg")
    assert [s.to_json() for s in loaded.inputs] == [s.to_json() for s in mlp_package.inputs]
    assert [(w.name, w.key) for w in loaded.weights] == [(w.name, w.key) for w in mlp_package.weights]
    for loaded_weight, compiled_weight in zip(loaded.weights, mlp_package.weights):
        np.testing.assert_array_equal(loaded_weight.value, compiled_weight.value)
    x = np.ones((5, 8), np.float32)
    np.testing.assert_allclose(loaded.session().run({"x": x})["y"],
                               mlp_package.session().run({"x": x})["y"])


def test_saving_over_an_existing_package_replaces_it_whole(mlp_package, convnet_model, tmp_path):
    destination = tmp_path / "model.tfpkg"
    mlp_package.save(destination)
    tightfit.compile(convnet_model).save(destination)
    assert [s.name for s in tightfit.load(destination).inputs] == ["image"]
    # the writers' lock file stays; no staging or retired directory does
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.tfpkg.lock", "model.tfpkg"]


def test_failed_save_leaves_no_partial_package(mlp_package, tmp_path, monkeypatch):
    def broken_export(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(tightfit.package, "write_weight_file", broken_export)
    with pytest.raises(OSError, match="disk full"):
        mlp_package.save(tmp_path / "model.tfpkg")
    assert list(tmp_path.iterdir()) == []


def test_loading_an_unfinished_or_truncated_package_is_refused(mlp_package, tmp_path):
    path = mlp_package.save(tmp_path / "m.tfpkg")
    weights = path / "weights.tfw"
    weights.write_bytes(weights.read_bytes()[:4200])  # inside the first blob (page 2)
    with pytest.raises(PackageError, match="truncated"):
        tightfit.load(path)
    (path / "manifest.json").unlink()
    with pytest.raises(PackageError, match="not a finished tightfit package"):
        tightfit.load(path)
    with pytest.raises(PackageError, match="no package at"):
        tightfit.load(tmp_path / "absent.tfpkg")


def test_malformed_onnx_file_raises_model_load_error(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07garbage that is not a protobuf \xff\xff")
    with pytest.raises(ModelLoadError, match="not a readable ONNX model"):
        tightfit.compile(bad)
    with pytest.raises(ModelLoadError, match="no ONNX file"):
        tightfit.compile(tmp_path / "missing.onnx")


def test_model_failing_the_onnx_checker_is_rejected_with_the_reason(mlp_model):
    broken = onnx.ModelProto()
    broken.CopyFrom(mlp_model)
    broken.graph.node[0].input[1] = "no_such_tensor"
    with pytest.raises(ModelLoadError, match="fails the ONNX checker"):
        tightfit.compile(broken)
