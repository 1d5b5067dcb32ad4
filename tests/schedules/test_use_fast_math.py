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
