"""The probe that RDP's soundness tests trust: it must see every binding, with true shapes."""

import numpy as np
import onnxruntime as ort
import pytest
import tvm
from tvm import relax
from hypothesis import given, settings
from hypothesis import strategies as st

import rdp_models
from shape_probe import ShapeProbe, with_probes
from tightfit.frontend import import_onnx
from tightfit.passes.classify_dynamism import ClassifyDynamism
from tightfit.pipeline import pass_name, passes
from tightfit.target import resolve_target


def normalizing_passes(target) -> list:
    """The pipeline's passes before ClassifyDynamism (dataflow, folding, decomposition)."""
    pipeline = passes(target)
    return pipeline[:[pass_name(p) for p in pipeline].index("tightfit.ClassifyDynamism")]


def normalized(model):
    mod = import_onnx(model).mod
    target = resolve_target("host")
    with target.tvm_target, tvm.transform.PassContext(opt_level=3):
        for compiler_pass in normalizing_passes(target):
            mod = compiler_pass(mod)
    return ClassifyDynamism()(mod)


@pytest.fixture(scope="module")
def if_model():
    model = rdp_models.if_different_shapes()
    return model, ShapeProbe(normalized(model))


def test_probe_sees_only_the_branch_taken(if_model):
    _, probe = if_model
    positive, _ = probe.run([np.full((3, 6), 1.0, np.float32)])
    negative, _ = probe.run([np.full((3, 6), -1.0, np.float32)])
    # then: a sum keeping dims gives (3, 1); else: a slice of two columns gives (3, 2)
    assert (3, 1) in {o.shape for o in positive.values()} - {o.shape for o in negative.values()}
    assert (3, 2) in {o.shape for o in negative.values()} - {o.shape for o in positive.values()}


def test_probe_records_values_of_shape_tensors_and_shapes():
    probe = ShapeProbe(normalized(rdp_models.reshape_to_computed_shape()))
    seen, _ = probe.run([np.ones((3, 10, 16), np.float32)])
    assert any(o.shape is None and o.values == (3, 10, 16) for o in seen.values())  # shape_of(x)
    assert any(o.shape == (3,) and o.values == (3, 10, 16) for o in seen.values())  # as a tensor


def test_probe_records_data_dependent_shapes():
    probe = ShapeProbe(normalized(rdp_models.nonzero_rows_tied()))
    seen, _ = probe.run([np.ones((5, 4), np.float32), np.ones((5, 8), np.float32)])
    assert any(o.shape == (1, 5) for o in seen.values())  # NonZero kept every row


def test_probe_refuses_modules_whose_binding_names_repeat():
    ty = relax.TensorType([2], "float32")
    x, first, second = relax.Var("x", ty), relax.Var("lv", ty), relax.Var("lv", ty)
    body = relax.SeqExpr([relax.BindingBlock([relax.VarBinding(first, relax.op.negative(x)),
                                              relax.VarBinding(second, relax.op.negative(first))])],
                         second)
    mod = tvm.IRModule({"main": relax.Function([x], body, ty)})
    with pytest.raises(ValueError, match="share names"):
        with_probes(mod)


@pytest.mark.parametrize("case", rdp_models.CASES, ids=lambda case: case.name)
def test_rdp_models_run_and_match_onnxruntime(case):
    model = case.build()
    probe = ShapeProbe(normalized(model))
    session = ort.InferenceSession(model.SerializeToString())
    names = [value.name for value in model.graph.input]

    @settings(max_examples=4, deadline=None, database=None)
    @given(st.data())
    def outputs_match(data):
        feeds = case.draw_inputs(data.draw)
        _, ours = probe.run([feeds[name] for name in names])
        for got, expected in zip(ours, session.run(None, feeds)):
            assert got.shape == expected.shape
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)

    outputs_match()
