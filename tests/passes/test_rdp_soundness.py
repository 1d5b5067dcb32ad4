"""RDP is sound: at every input hypothesis draws, every binding's run-time shape (and the values of
shape tensors) equals what RDP predicted, evaluated at that run's symbols.

For each zoo model and each model of `rdp_models`, the module RDP rewrote (solved symbols
substituted, tighter match_casts inserted) is compiled once with a probe after every binding
(`shape_probe`), then run at drawn inputs: valid shapes only (what onnxruntime accepts), and data
that drives NonZero and If both ways. The rewritten module's outputs must equal onnxruntime's —
RDP may not change a value. A wrong prediction is a failure, never a skip.
"""

from __future__ import annotations

import time

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import tirx

import rdp_models
from predictions import Check, Unbound, evaluate
from shape_probe import ShapeProbe
from test_shape_probe import normalized
from tightfit.feeds import random_feeds
from tightfit.frontend import declared_inputs
from tightfit.passes.rdp import RankDimensionPropagation, analyze_module
from tightfit.testing import zoo

EXAMPLES_PER_MODEL = 8
SHAPES_TRIED: dict[str, int] = {}  # model -> runs compared (reported by the summary test)


def _randn(draw, shape):
    seed = draw(st.integers(0, 2**16))
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _images(height: st.SearchStrategy, width: st.SearchStrategy, batch=st.integers(1, 3)):
    def draw_inputs(draw):
        return {"image": _randn(draw, (draw(batch), 3, draw(height), draw(width)))}
    return draw_inputs


def _gated(draw):
    shape = (draw(st.integers(1, 3)), 8, 16, 16)
    sign = draw(st.sampled_from([1.0, -1.0]))  # the If's gate both ways
    return {"x": _randn(draw, shape) + sign}


def _nonzero_gather(draw):
    rows = draw(st.integers(1, 10))
    density = draw(st.sampled_from([0.1, 0.5, 1.0]))  # how many positions NonZero keeps
    x = _randn(draw, (rows, 12))
    x = np.where(np.random.default_rng(rows).random((rows, 12)) < density, np.abs(x) + 0.1, -np.abs(x))
    return {"x": x.astype(np.float32), "table": _randn(draw, (12, 16))}


def _tokens(draw):
    shape = (draw(st.integers(1, 3)), draw(st.integers(1, 24)))
    return {"tokens": np.random.default_rng(draw(st.integers(0, 99))).integers(0, 100, shape)}


# Valid inputs of each zoo model; a model added to the zoo later is drawn from its own shape sets.
ZOO_INPUTS = {
    "resnet_style": _images(st.just(32), st.just(32), st.integers(1, 4)),
    "mobilenet_v2_style": _images(st.integers(8, 72), st.integers(8, 72)),
    "conv_dynamic_hw": _images(st.integers(2, 64), st.integers(2, 64), st.just(1)),
    "gated_skip_block": _gated,
    "nonzero_gather": _nonzero_gather,
    "topk_computed_k": lambda draw: {"scores": _randn(draw, (draw(st.integers(1, 3)), draw(st.integers(4, 48))))},
    "transformer_encoder": _tokens,
    "detector_fpn": _images(st.integers(2, 12).map(lambda i: 4 * i), st.integers(2, 12).map(lambda i: 4 * i)),
    "speech_encoder": lambda draw: {"features": _randn(draw, (draw(st.integers(1, 2)), draw(st.integers(4, 64)), 40))},
    "torch_transformer_layers": lambda draw: {"x": _randn(draw, (draw(st.integers(1, 3)), draw(st.integers(1, 16)), 32))},
}
# The dynamo exports of the PyTorch models take the same inputs as the TorchScript ones.
ZOO_INPUTS.update({f"{name}_dynamo": ZOO_INPUTS[name]
                   for name in ("transformer_encoder", "detector_fpn", "speech_encoder")})
ZOO_INPUTS["transformer_encoder_wide"] = _tokens
ZOO_INPUTS.update({case.name: case.draw_inputs for case in rdp_models.CASES})


def _zoo_inputs(name: str):
    if name in ZOO_INPUTS:
        return ZOO_INPUTS[name]
    entry = zoo.get(name)

    def from_shape_sets(draw):
        shapes = draw(st.sampled_from(entry.shape_sets))
        model = entry.build()
        return entry.feeds(shapes) if entry.feeds else random_feeds(declared_inputs(model.graph), shapes)
    return from_shape_sets


MODELS = [(name, (lambda name=name: zoo.get(name).build()), _zoo_inputs(name)) for name in zoo.names()]


def compare(check: Check, name: str, fact, observation) -> None:
    """Every claim of one RDP fact against one observation."""
    kind = fact.kind
    if kind == "tensor":
        if observation.shape is None:
            check.mismatches.append((name, "kind", "tensor", observation))
            return
        if isinstance(fact.rank, int):
            check.compared += 1
            if fact.rank != len(observation.shape):
                check.mismatches.append((name, "rank", fact.rank, observation.shape))
                return
            for axis, (dim, seen) in enumerate(zip(fact.dims, observation.shape)):
                check.claim(name, f"dim {axis}", dim, seen)
        if fact.values is not None and observation.values is not None:
            for index, (value, seen) in enumerate(zip(fact.values, observation.values)):
                check.claim(name, f"value {index}", value, seen)
    elif kind in ("shape", "prim") and fact.values is not None and observation.values is not None:
        if len(fact.values) != len(observation.values):
            check.mismatches.append((name, "length", len(fact.values), observation.values))
            return
        for index, (value, seen) in enumerate(zip(fact.values, observation.values)):
            check.claim(name, f"value {index}", value, seen)
    elif kind == "tuple" and observation.fields is not None:
        for index, (field, seen) in enumerate(zip(fact.fields, observation.fields)):
            compare(check, f"{name}[{index}]", field, seen)


def proven_equalities(result) -> list:
    """The symbolic equalities RDP proved (solved cut symbols, and equalities it had to keep):
    each must hold at run time too."""
    symbols = result.symbols
    pairs = [(var, symbols.normalize(var)) for var in symbols.solved]
    pairs += [(a, b) for a, b, _ in symbols.equalities]
    return [(a, b) for a, b in pairs if _integer(a) and _integer(b)]


def _integer(expr) -> bool:
    ty = getattr(expr, "ty", None)
    return ty is not None and str(getattr(ty, "dtype", "")).startswith("int")


@pytest.mark.parametrize("name, build, draw_inputs", MODELS, ids=[m[0] for m in MODELS])
def test_rdp_predictions_hold_at_every_drawn_input(name, build, draw_inputs):
    model = build()
    classified = normalized(model)
    result = analyze_module(classified)
    facts = {var.name: fact for var, fact in result.facts.items()}
    rewritten = RankDimensionPropagation()(classified)
    probe = ShapeProbe(rewritten)
    session = ort.InferenceSession(model.SerializeToString())
    inputs = [spec.name for spec in declared_inputs(model.graph)]
    params = classified["main"].params[:len(inputs)]
    runs = 0

    @settings(max_examples=EXAMPLES_PER_MODEL, deadline=None, database=None)
    @given(st.data())
    def predictions_hold(data):
        nonlocal runs
        feeds = draw_inputs(data.draw)
        observed, outputs = probe.run([feeds[input_name] for input_name in inputs])
        for got, expected in zip(outputs, session.run(None, feeds)):
            assert got.shape == expected.shape
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
        env = {}
        for param in params:
            for dim, size in zip(param.ty.shape.values, feeds[param.name].shape):
                if isinstance(dim, tirx.Var):
                    env.setdefault(dim, size)
        check = Check(env)
        for binding, observation in observed.items():
            if binding in facts:
                compare(check, binding, facts[binding], observation)
        check.finish()
        for lhs, rhs in proven_equalities(result):
            try:  # a cut symbol no observation bound (substituted everywhere) cannot be checked
                left, right = evaluate(lhs, check.env), evaluate(rhs, check.env)
            except Unbound:
                continue
            check.compared += 1
            if left != right:
                check.mismatches.append(("equality", f"{lhs} == {rhs}", left, right))
        shapes = {input_name: feeds[input_name].shape for input_name in inputs}
        assert not check.mismatches, f"{name} at {shapes}: RDP predicted wrongly: {check.mismatches}"
        assert check.compared > 0
        runs += 1

    started = time.perf_counter()
    predictions_hold()
    SHAPES_TRIED[name] = runs
    print(f"{name}: {runs} input shapes, {time.perf_counter() - started:.1f} s")
