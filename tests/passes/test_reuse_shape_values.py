"""ReuseShapeValues: a shape value is built once per run where one call dominates the others."""

import numpy as np
import pytest
from tvm import relax

import tightfit
from tightfit.feeds import run_onnxruntime
from tightfit.frontend import import_onnx
from tightfit.passes.reuse_shape_values import SHAPE_BUILTINS
from tightfit.pipeline import run_pipeline
from tightfit.target import resolve_target
from tightfit.testing import zoo

REUSED = "tightfit.ReuseShapeValues"


def _shape_calls(seq: relax.SeqExpr, scope: tuple = ()) -> list[tuple]:
    """(enclosing branches, builtin, arguments) of each shape builtin call in `seq`."""
    calls = []
    for block in seq.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.If):
                calls += _shape_calls(value.true_branch, scope + ((id(value), "then"),))
                calls += _shape_calls(value.false_branch, scope + ((id(value), "else"),))
            elif (isinstance(value, relax.Call) and isinstance(value.op, relax.ExternFunc)
                  and value.op.global_symbol in SHAPE_BUILTINS):
                calls.append((scope, value.op.global_symbol, tuple(str(a) for a in value.args[1:])))
    return calls


@pytest.mark.parametrize("name", ["nonzero_rows_tied", "gated_skip_block", "if_different_shapes"])
def test_no_shape_is_built_twice_where_the_first_build_dominates(name):
    mod, _ = run_pipeline(import_onnx(zoo.get(name).build()).mod, resolve_target("host"),
                          stop_after=REUSED)
    relax.analysis.well_formed(mod)  # raises unless every reused var is defined where used
    calls = _shape_calls(mod["main"].body)
    for index, (scope, builtin, args) in enumerate(calls):
        for other_scope, other_builtin, other_args in calls[:index]:
            dominates = scope[:len(other_scope)] == other_scope
            assert not (dominates and (builtin, args) == (other_builtin, other_args)), (builtin, args)


def test_nonzero_rows_tied_builds_each_distinct_shape_once_and_still_matches_onnxruntime():
    spec = zoo.get("nonzero_rows_tied")
    model = spec.build()
    mod, _ = run_pipeline(import_onnx(model).mod, resolve_target("host"), stop_after=REUSED)
    calls = _shape_calls(mod["main"].body)
    assert len(calls) == len({(builtin, args) for _, builtin, args in calls})
    session = tightfit.compile(model).session()
    for rows in (1, 3, 7):
        rng = np.random.default_rng(rows)
        feeds = {"x": rng.standard_normal((rows, 4)).astype("float32"),
                 "v": rng.standard_normal((rows, 8)).astype("float32")}
        expected = run_onnxruntime(model, feeds)
        for output, got in session.run(feeds).items():
            np.testing.assert_allclose(got, expected[output], rtol=1e-5, atol=1e-5, err_msg=output)
