"""Keep one copy of each kernel that fusion made more than once.

MNN's pre-inference (§3.2) prepares each distinct op once; SoD2's multi-version kernels (§4.2)
make every kernel several versions, so a copy is scheduled, lowered and compiled several times
over. Models repeat their blocks: MobileNetV2's fused kernels are 57 PrimFuncs but 37 distinct
ones (its repeated bottlenecks at the same resolution and width), ResNet-18's 66 and 32, a
two-layer transformer encoder's 27 and 14. Each copy cost its share of ScheduleKernels, TIR
lowering and LLVM: MobileNetV2 compiled in 64 s with them, 48 s without.

After FuseTIR every kernel is its own PrimFunc, named after its ops (`fused_conv2d3_add5`):
two whose bodies are equal up to the names of their buffers and vars (`structural_equal`)
compute the same thing, and each call of a copy becomes a call of the first. Runs before
scheduling, so the schedules, the knob database and the tuning records see each kernel once.
Limits: only PrimFuncs, and only copies equal as written (a kernel equal to another after
simplification stays two).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, tirx

# The module attribute counting the copies this pass removed (the compile report's
# "shared_kernel_copies")
SHARED_COPIES_ATTR = "tightfit.shared_kernel_copies"


@tvm.transform.module_pass(opt_level=0, name="tightfit.ShareIdenticalKernels")
class ShareIdenticalKernels:
    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        kept_by_hash: dict[int, list[tuple[tvm.ir.GlobalVar, tirx.PrimFunc]]] = {}
        replacement: dict[tvm.ir.GlobalVar, tvm.ir.GlobalVar] = {}
        for global_var, func in sorted(mod.functions.items(), key=lambda item: item[0].name_hint):
            if not isinstance(func, tirx.PrimFunc):
                continue
            # the symbol is the function's own name, not part of what it computes
            body = func.without_attr("global_symbol")
            kept = kept_by_hash.setdefault(tvm_ffi.structural_hash(body), [])
            original = next((kept_var for kept_var, kept_func in kept
                             if tvm_ffi.structural_equal(kept_func, body)), None)
            if original is None:
                kept.append((global_var, body))
            else:
                replacement[global_var] = original
        if not replacement:
            return mod
        builder = relax.BlockBuilder(mod)
        for global_var, func in mod.functions.items():
            if isinstance(func, relax.Function):
                builder.update_func(global_var, _CallsRedirected(replacement).visit_expr(func))
        shared = builder.get()
        for copy in replacement:
            del shared[copy]
        return shared.with_attr(SHARED_COPIES_ATTR, tirx.IntImm("int64", len(replacement)))


@relax.expr_functor.mutator
class _CallsRedirected(relax.PyExprMutator):
    def __init__(self, replacement: dict):
        super().__init__()
        self.replacement = replacement

    def visit_global_var_(self, op: tvm.ir.GlobalVar) -> relax.Expr:
        return self.replacement.get(op, op)
