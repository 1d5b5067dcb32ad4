"""Keep one copy of each kernel that fusion made more than once.

MNN's pre-inference (§3.2) prepares each distinct op once; SoD2's multi-version kernels (§4.2)
make every kernel several versions, so a copy is scheduled, lowered and compiled several times
over. Models repeat their blocks: MobileNetV2's 54 fused kernels are 32 distinct ones (its
repeated bottlenecks at the same resolution and width), ResNet-18's 66 at most 32, a two-layer
transformer encoder's 27 at most 14. Each copy cost its share of ScheduleKernels, TIR lowering
and LLVM: MobileNetV2 compiled in 64 s with them, 42-48 s without.

After FuseTIR every kernel is its own PrimFunc, named after its ops (`fused_conv2d3_add5`):
two whose bodies are equal up to the names of their buffers and vars (`structural_equal`)
compute the same thing, and each call of a copy becomes a call of the first. FuseTIR passes a
kernel's symbolic dims as scalar inputs in an order that changes from one compile to the next
(`height, width` in one kernel, `width, height` in its twin), so they are put in name order
first, and the calls' arguments with them: the sharing, and the kernels, are then the same in
every compile (MobileNetV2 kept 32-37 kernels before, 32 every time after). Runs before
scheduling, so the schedules, the knob database and the tuning records see each kernel once.
Limits: only PrimFuncs, only copies equal as written (a kernel equal to another after
simplification stays two), and dims reordered only in kernels used by `call_tir` alone.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax, tirx

# The module attribute counting the copies this pass removed (the compile report's
# "shared_kernel_copies")
SHARED_COPIES_ATTR = "tightfit.shared_kernel_copies"
CALL_TIR = tvm.ir.Op.get("relax.call_tir")


@tvm.transform.module_pass(opt_level=0, name="tightfit.ShareIdenticalKernels")
class ShareIdenticalKernels:
    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        inputs = _call_tir_inputs(mod)
        kept_by_hash: dict[int, list[tuple[tvm.ir.GlobalVar, tirx.PrimFunc]]] = {}
        # each rewritten kernel: the kernel its calls go to, and the order of their arguments
        rewrites: dict[tvm.ir.GlobalVar, tuple[tvm.ir.GlobalVar, list[int]]] = {}
        canonical_kernels: dict[tvm.ir.GlobalVar, tirx.PrimFunc] = {}
        copies = 0
        for global_var, func in sorted(mod.functions.items(), key=lambda item: item[0].name_hint):
            if not isinstance(func, tirx.PrimFunc):
                continue
            order = _canonical_order(func, inputs.get(global_var))
            reordered = tirx.PrimFunc([func.params[i] for i in order], func.body, func.ret_type, func.attrs)
            # the symbol is the function's own name, not part of what it computes
            canonical = reordered.without_attr("global_symbol")
            kept = kept_by_hash.setdefault(tvm_ffi.structural_hash(canonical), [])
            original = next((kept_var for kept_var, kept_func in kept
                             if tvm_ffi.structural_equal(kept_func, canonical)), None)
            if original is None:
                kept.append((global_var, canonical))
                original = global_var
                if order != sorted(order):
                    canonical_kernels[global_var] = reordered
            else:
                copies += 1
            if not original.same_as(global_var) or order != sorted(order):
                rewrites[global_var] = (original, order)
        if not rewrites:
            return mod
        builder = relax.BlockBuilder(mod)
        for global_var, func in mod.functions.items():
            if isinstance(func, relax.Function):
                builder.update_func(global_var, _CallsRedirected(rewrites).visit_expr(func))
        for global_var, canonical in canonical_kernels.items():
            builder.update_func(global_var, canonical)
        shared = builder.get()
        for copy, (original, _) in rewrites.items():
            if not original.same_as(copy):
                del shared[copy]
        return shared.with_attr(SHARED_COPIES_ATTR, tirx.IntImm("int64", copies))


def _canonical_order(func: tirx.PrimFunc, inputs: int | None) -> list[int]:
    """The order of `func`'s params with its scalar inputs (the symbolic dims FuseTIR passes, in
    an order that changes from one compile to the next) sorted by name; the params as they are
    when `func` has a use other than `call_tir` with its inputs in a tuple (`inputs` None)."""
    order = list(range(len(func.params)))
    if inputs is None:
        return order
    scalars = [i for i in range(inputs) if isinstance(func.params[i].ty, tvm.ir.PrimType)]
    for slot, i in zip(scalars, sorted(scalars, key=lambda i: func.params[i].name)):
        order[slot] = i
    return order


def _call_tir_inputs(mod: tvm.IRModule) -> dict[tvm.ir.GlobalVar, int]:
    """For each kernel that the Relax functions use only as the callee of `call_tir` with a
    tuple of inputs, the number of those inputs."""
    callees: dict[tvm.ir.GlobalVar, set[int]] = {}
    references: dict[tvm.ir.GlobalVar, int] = {}

    def visit(node):
        if isinstance(node, tvm.ir.GlobalVar):
            references[node] = references.get(node, 0) + 1
        elif (isinstance(node, relax.Call) and node.op.same_as(CALL_TIR) and len(node.args) == 2
              and isinstance(node.args[1], relax.Tuple)):
            callees.setdefault(node.args[0], set()).add(len(node.args[1].fields))
            references[node.args[0]] = references.get(node.args[0], 0) - 1

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return {global_var: counts.pop() for global_var, counts in callees.items()
            if len(counts) == 1 and references.get(global_var) == 0}


@relax.expr_functor.mutator
class _CallsRedirected(relax.PyExprMutator):
    def __init__(self, rewrites: dict):
        super().__init__()
        self.rewrites = rewrites

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not (call.op.same_as(CALL_TIR) and call.args[0] in self.rewrites):
            return call
        callee, order = self.rewrites[call.args[0]]
        inputs = call.args[1].fields
        arguments = relax.Tuple([inputs[i] for i in order[:len(inputs)]])
        return relax.Call(call.op, [callee, arguments, *call.args[2:]], call.attrs, call.ty_args, call.span)
