"""UseFastMath swaps exp/erf/tanh/softmax for TOPI's polynomials, within float32 tolerance."""

import math

import numpy as np
import pytest
import tvm
from tvm import relax

from tightfit.passes import UseFastMath
from tightfit.schedules import FallbackCPUSchedule

HOST = tvm.target.Target({"kind": "llvm", "num-cores": 2})


def one_op(build_op) -> tvm.IRModule:
    x = relax.Var("x", relax.TensorType([tvm.tirx.Var("n", "int64"), 24], "float32"))
    builder = relax.BlockBuilder()
    with builder.function("main", [x]):
        with builder.dataflow():
            out = builder.emit_output(build_op(x))
        builder.emit_func_output(out)
    return builder.get()


CASES = {
    "exp": (relax.op.exp, np.exp),
    "erf": (relax.op.erf, np.vectorize(math.erf)),
    "tanh": (relax.op.tanh, np.tanh),
    "softmax": (lambda x: relax.op.nn.softmax(x, axis=-1),
                lambda a: np.exp(a - a.max(-1, keepdims=True)) / np.exp(a - a.max(-1, keepdims=True)).sum(-1, keepdims=True)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fast_version_replaces_the_op_and_matches_numpy(name):
    build_op, reference = CASES[name]
    mod = UseFastMath()(one_op(build_op))
    assert f"relax.{'nn.' if name == 'softmax' else ''}{name}" not in mod.script()
    assert f"fast_{name}" in mod.script()
    with HOST, tvm.transform.PassContext(opt_level=3):
        mod = relax.transform.LegalizeOps()(mod)
        mod = FallbackCPUSchedule()(mod)
        executable = tvm.compile(mod, HOST)
    values = np.linspace(-80 if name == "exp" else -9, 80 if name == "exp" else 9, 5 * 24)
    values = values.reshape(5, 24).astype(np.float32)
    ours = relax.VirtualMachine(executable, tvm.cpu())["main"](tvm.runtime.tensor(values)).numpy()
    expected = reference(values.astype(np.float64))
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("divisor", [np.float32(np.sqrt(2.0)), np.float32(-3.0),
                                     np.linspace(0.5, 7.5, 24, dtype=np.float32)],
                         ids=["scalar", "negative", "per-column"])
def test_division_by_a_constant_becomes_a_multiplication_by_its_reciprocal(divisor):
    mod = UseFastMath()(one_op(lambda x: relax.op.divide(x, relax.const(divisor))))
    assert "R.divide(" not in mod.script() and "R.multiply(" in mod.script()
    values = np.random.default_rng(0).standard_normal((5, 24)).astype(np.float32) * 100
    np.testing.assert_allclose(_run(mod, values), values / divisor, rtol=3e-7, atol=0)


# (a scalar zero is left out: TVM's legalization folds x / 0 into a compile error)
@pytest.mark.parametrize("divisor", [np.float32(1e-40), np.float32(1e-39 * 1e-1),
                                     np.array([1.0, np.inf] * 12, np.float32),
                                     np.array([1.0, 0.0] * 12, np.float32)],
                         ids=["subnormal", "smaller-subnormal", "infinity", "zero"])
def test_division_by_a_constant_without_a_normal_reciprocal_stays_a_division(divisor):
    mod = UseFastMath()(one_op(lambda x: relax.op.divide(x, relax.const(divisor))))
    assert "R.divide(" in mod.script()
    values = np.linspace(-9, 9, 5 * 24, dtype=np.float32).reshape(5, 24)
    values[0, :2] = 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        expected = values / divisor
    np.testing.assert_array_equal(_run(mod, values), expected)


def test_an_integer_division_by_a_constant_stays_a_division():
    x = relax.Var("x", relax.TensorType([4], "int32"))
    builder = relax.BlockBuilder()
    with builder.function("main", [x]):
        with builder.dataflow():
            out = builder.emit_output(relax.op.divide(x, relax.const(np.int32(3))))
        builder.emit_func_output(out)
    assert "R.divide(" in UseFastMath()(builder.get()).script()


def _run(mod: tvm.IRModule, values: np.ndarray) -> np.ndarray:
    with HOST, tvm.transform.PassContext(opt_level=3):
        mod = relax.transform.LegalizeOps()(mod)
        mod = FallbackCPUSchedule()(mod)
        executable = tvm.compile(mod, HOST)
    return relax.VirtualMachine(executable, tvm.cpu())["main"](tvm.runtime.tensor(values)).numpy()
