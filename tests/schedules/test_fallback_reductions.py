"""The fallback schedule runs a reduction over trailing dims as one loop, and stays exact.

A mean over H and W reads one contiguous run per output: its two loops become one (LLVM then
vectorizes one long loop). Reductions over dims that are not trailing keep their loops.
"""

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import relax

from kernel_harness import assert_close, compile_with_kernels, dims, one_op_module, run

REDUCTIONS = {
    # name: (relax op, numpy op, axes, whether the reduction loops are fused)
    "mean_hw": (relax.op.mean, np.mean, [2, 3], True),
    "sum_hw": (relax.op.sum, np.sum, [2, 3], True),
    "max_chw": (relax.op.max, np.max, [1, 2, 3], True),
    "sum_ch": (relax.op.sum, np.sum, [1, 2], False),
}


def _fused_reduction_loops(mod) -> bool:
    return any(re.search(r"for k\d+_k\d+(_k\d+)?_fused in", mod[gv].script())
               for gv in mod.functions if gv.name_hint != "main")


@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_reductions_over_symbolic_dims_match_numpy(name):
    relax_op, numpy_op, axes, fused = REDUCTIONS[name]
    mod = one_op_module([("x", dims("n", 16, "h", "w"))], [],
                        lambda builder, x: relax_op(x, axis=axes, keepdims=True))
    scheduled, executable = compile_with_kernels(mod)
    assert _fused_reduction_loops(scheduled) == fused

    @settings(max_examples=12, deadline=None)
    @given(st.integers(1, 3), st.integers(1, 40), st.integers(1, 40))
    def check(batch, height, width):
        x = np.random.default_rng(height * width).standard_normal((batch, 16, height, width)).astype(np.float32)
        expected = numpy_op(x.astype(np.float64), axis=tuple(axes), keepdims=True)
        assert_close(run(executable, x), expected, f"{name} of {x.shape}")

    check()
