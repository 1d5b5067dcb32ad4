"""Replace exp, erf, tanh and softmax with TOPI's polynomial versions, which vectorize.

Issue 5, the memory-bound ops: the legalized exp/erf/tanh become calls to libm's expf/erff/
tanhf, one per element, and no vectorizer crosses a call; softmax (an exp per score) was the
largest kernel of the transformer at (2, 33) tokens (2 x 20 us for 2 x 8712 scores).
topi.fast_exp (range reduction to 2^n x a degree-7 polynomial), fast_erf and fast_tanh
(rational approximations, as Eigen's) are plain arithmetic that LLVM vectorizes; their float32
error is a few ulp, within the 1e-4 tolerance the outputs are held to against onnxruntime.
Only float32 calls of the four ops are replaced; other dtypes keep the exact versions.
"""

from __future__ import annotations

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


def _is_float32(call: relax.Call) -> bool:
    return isinstance(call.ty, relax.TensorType) and call.ty.dtype == "float32"
