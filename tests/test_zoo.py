"""Every zoo model compiles once and matches onnxruntime at each of its shapes."""

import functools
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tightfit
from tightfit.feeds import random_feeds, run_onnxruntime
from tightfit.frontend import declared_inputs
from tightfit.session import Session
from tightfit.testing import zoo


def build(entry: zoo.ZooModel):
    """The entry's model; a skip when it is exported from PyTorch and torch is not installed."""
    try:
        return entry.build()
    except ModuleNotFoundError as err:
        if err.name != "torch":
            raise
        pytest.skip(f"{entry.name} is exported from PyTorch, which is not installed")


# The CNNs that are also drawn at other image sizes: under pytest-xdist both tests of one run
# on the same worker, which compiles it once (`compiled`).
DRAWN_CNNS = ["conv_dynamic_hw", "grouped_convnet", "mobilenet_v2_style"]


def on_one_worker(names: list[str]) -> list:
    return [pytest.param(name, marks=pytest.mark.xdist_group(f"zoo-{name}")) if name in DRAWN_CNNS
            else name for name in names]


@functools.cache
def compiled(name: str) -> tuple[tightfit.Package, Session]:
    package = tightfit.compile(build(zoo.get(name)))
    return package, package.session()


@pytest.mark.slow
@pytest.mark.parametrize("name", on_one_worker(zoo.names()))
def test_zoo_model_matches_onnxruntime_at_every_shape_with_one_package(name):
    entry = zoo.get(name)
    model = build(entry)
    package, session = compiled(name)
    # TVM implements some ops (nonzero, unique) as Python callbacks, which a phone's C++ runtime
    # lacks: the compiled code must call only its own kernels and the VM's builtins
    called = re.search(r"Globals \(#\d+\): \[(.*?)\]", package.executable.stats()).group(1).split(", ")
    assert [name for name in called if name.startswith("relax.run.")] == []
    for shapes in entry.shape_sets:
        feeds = entry.feeds(shapes) if entry.feeds else random_feeds(declared_inputs(model.graph), shapes)
        ours = session.run(feeds)
        reference = run_onnxruntime(model, feeds)
        assert list(ours) == list(reference)
        for output, expected in reference.items():
            assert ours[output].shape == expected.shape, (output, shapes)
            assert ours[output].dtype == expected.dtype, (output, shapes)
            np.testing.assert_allclose(ours[output], expected, rtol=1e-4, atol=1e-4,
                                       err_msg=f"{name} {output} at {shapes}")


@pytest.mark.slow
@pytest.mark.parametrize("name", on_one_worker(DRAWN_CNNS))
@settings(max_examples=12, deadline=None)
@given(batch=st.integers(1, 3), height=st.integers(8, 72), width=st.integers(8, 72))
def test_zoo_cnns_match_onnxruntime_at_drawn_image_sizes(name, batch, height, width):
    """One package per CNN at image sizes its shape sets do not name: widths narrower and wider
    than a vector, odd sizes at every stride, all through the kernels' run-time versions."""
    model = zoo.get(name).build()
    shape = (1 if name == "conv_dynamic_hw" else batch, 3, height, width)  # its batch is fixed
    feeds = random_feeds(declared_inputs(model.graph), {"image": shape})
    ours, reference = compiled(name)[1].run(feeds), run_onnxruntime(model, feeds)
    for output, expected in reference.items():
        assert ours[output].shape == expected.shape, (output, shape)
        np.testing.assert_allclose(ours[output], expected, rtol=1e-4, atol=1e-4,
                                   err_msg=f"{name} {output} at {shape}")


def test_gated_model_takes_both_branches():
    entry = zoo.get("gated_skip_block")
    gates = {bool(entry.feeds(shapes)["x"].mean() > 0) for shapes in entry.shape_sets}
    assert gates == {True, False}


def test_zoo_lists_unique_names_and_dynamic_models_have_several_shape_sets():
    assert len(set(zoo.names())) == len(zoo.names())
    with pytest.raises(KeyError, match="the zoo has"):
        zoo.get("no_such_model")
    for name in zoo.names():
        entry = zoo.get(name)
        assert entry.name == name
        assert len(entry.shape_sets) >= (2 if entry.dynamic else 1)


def test_a_dynamic_entry_with_one_shape_set_is_rejected():
    with pytest.raises(ValueError, match="fewer than two shape sets"):
        zoo.ZooModel(name="m", build=lambda: None, shape_sets=[{"x": (1,)}], feeds=None,
                     dynamic=True, description="")


def test_zoo_models_are_built_the_same_every_time():
    entry = zoo.get("resnet_style")
    assert entry.build().SerializeToString() == entry.build().SerializeToString()


def test_a_pytorch_export_is_made_once_and_then_read_from_the_user_cache(monkeypatch, tmp_path):
    """The dynamo exporter takes 4-9 s a model, in every process that builds one; the cached
    file is named by the builder's arguments as bound (defaults included)."""
    pytest.importorskip("torch")
    pytest.importorskip("onnxscript")  # without it, nothing is cached
    monkeypatch.setenv("TIGHTFIT_CACHE", str(tmp_path))
    exported = zoo.transformer_encoder().SerializeToString()

    def no_export(*args, **kwargs):
        raise AssertionError("exported again")

    monkeypatch.setattr(zoo, "_export", no_export)
    assert zoo.transformer_encoder(False, width=32).SerializeToString() == exported
    assert zoo.get("transformer_encoder").build().SerializeToString() == exported
    with pytest.raises(AssertionError, match="exported again"):
        zoo.transformer_encoder(width=64)  # another model
    assert len(list((tmp_path / "zoo").iterdir())) == 1
