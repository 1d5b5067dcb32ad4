"""Replace exp, erf, tanh and softmax with TOPI's polynomial versions, which vectorize.

Issue 5, the memory-bound ops: the legalized exp/erf/tanh become calls to libm's expf/erff/
tanhf, one per element, and no vectorizer crosses a call; softmax (an exp per score) was the
largest kernel of the transformer at (2, 33) tokens (2 x 20 us for 2 x 8712 scores).
topi.fast_exp (range reduction to 2^n x a degree-7 polynomial), fast_erf and fast_tanh
(rational approximations, as Eigen's) are plain arithmetic that LLVM vectorizes; their float32
error is a few ulp, within the 1e-4 tolerance the outputs are held to against onnxruntime.
Only float32 calls of the four ops are replaced; other dtypes keep the exact versions.

A float32 tensor divided by a constant becomes a multiplication by the constant's reciprocal,
computed once here, where every reciprocal is a normal float (`_reciprocal`). LLVM keeps
x / c a division (only exact reciprocals are folded without fast-math flags, and those flags
would also reach index arithmetic, where a reciprocal can move a float coordinate across an
integer), and a vector division occupies Zen 4's divider for several cycles: the exported
GELU's x / sqrt(2) and attention's scores / sqrt(d) were 2 of a GELU epilogue's ~30 vector ops
and the scores kernel's only ones besides its multiply-adds. x x (1 / c) differs from x / c by
at most an ulp or so. transformer_encoder_dynamo, VM time, medians of 11 alternating turns
(Zen 4 host, 2 threads): 5.78 -> 5.68 us at 1x5, 31.04 -> 30.39 us at 3x16; the zoo's other
transformers compute their scales at run time (within 1%).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, topi

_FAST = {
    "relax.exp": topi.fast_exp,
    "relax.erf": topi.fast_erf,
    "relax.tanh": topi.fast_tanh,
}


@relax.expr_functor.mutator
class _FastMathRewriter(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if not isinstance(call.op, tvm.ir.Op) or not _is_float32(call):
            return call
        if call.op.name == "relax.nn.softmax":
            return self.builder_.call_te(topi.nn.fast_softmax, call.args[0], int(call.attrs.axis),
                                         primfunc_name_hint="fast_softmax")
        if call.op.name == "relax.divide" and (reciprocal := _reciprocal(call.args[1])) is not None:
            return relax.op.multiply(call.args[0], reciprocal)
        if call.op.name in _FAST:
            return self.builder_.call_te(_FAST[call.op.name], call.args[0],
                                         primfunc_name_hint="fast_" + call.op.name.split(".")[-1])
        return call


@tvm.transform.module_pass(opt_level=0, name="tightfit.UseFastMath")
class UseFastMath:
    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        rewriter = _FastMathRewriter(mod)
        for global_var, func in list(mod.functions.items()):
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(global_var, rewriter.visit_expr(func))
        return rewriter.builder_.get()


def _reciprocal(divisor: relax.Expr) -> tvm.ir.GenericConst | None:
    """1 / `divisor` as a constant, if it is a float32 constant whose every reciprocal is a
    normal float (no zero, infinity or subnormal on either side: x / 0 is not x x inf for x = 0,
    and 1 / a subnormal overflows)."""
    if not isinstance(divisor, tvm.ir.GenericConst) or divisor.value.dtype != "float32":
        return None
    values = divisor.value.numpy()
    with np.errstate(divide="ignore", over="ignore"):
        reciprocals = np.float32(1) / values
    tiny = np.finfo(np.float32).tiny
    if not (np.all(np.abs(values) >= tiny) and np.all(np.isfinite(reciprocals))
            and np.all(np.abs(reciprocals) >= tiny)):
        return None
    return relax.const(reciprocals, "float32")


def _is_float32(call: relax.Call) -> bool:
    return isinstance(call.ty, relax.TensorType) and call.ty.dtype == "float32"
