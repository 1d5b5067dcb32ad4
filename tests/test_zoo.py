"""Every zoo model compiles once and matches onnxruntime at each of its shapes."""

import pytest

import tightfit
from tightfit.feeds import random_feeds, run_onnxruntime
from tightfit.frontend import declared_inputs
from tightfit.testing import zoo

import numpy as np


@pytest.mark.slow
@pytest.mark.parametrize("name", zoo.names())
def test_zoo_model_matches_onnxruntime_at_every_shape_with_one_package(name):
    entry = zoo.get(name)
    if entry.needs_torch:
        pytest.importorskip("torch")
    model = entry.build()
    session = tightfit.compile(model).session()
    for shapes in entry.shape_sets:
        feeds = entry.feeds(shapes) if entry.feeds else random_feeds(declared_inputs(model.graph), shapes)
        ours = session.run(feeds)
        reference = run_onnxruntime(model, feeds)
        assert list(ours) == list(reference)
        for output, expected in reference.items():
            assert ours[output].shape == expected.shape, (output, shapes)
            np.testing.assert_allclose(ours[output], expected, rtol=1e-4, atol=1e-4,
                                       err_msg=f"{name} {output} at {shapes}")


def test_gated_model_takes_both_branches():
    entry = zoo.get("gated_skip_block")
    gates = {bool(entry.feeds(shapes)["x"].mean() > 0) for shapes in entry.shape_sets}
    assert gates == {True, False}


def test_zoo_names_are_unique_and_dynamic_models_have_several_shapes():
    assert len(set(zoo.names())) == len(zoo.names())
    with pytest.raises(KeyError, match="the zoo has"):
        zoo.get("no_such_model")
    assert all(zoo.get(name).dynamic for name in zoo.names())
