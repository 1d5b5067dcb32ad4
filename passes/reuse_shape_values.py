"""Build each shape value of a run once: later requests for the same one reuse it.

MNN §3.2 (pre-allocation: the work a run repeats is done once). VMShapeLower writes each
symbolic dim's value into the function's shape heap once, then builds a shape (for an
allocation, a view) or a scalar (for a kernel's dim argument) from heap slots wherever one is
needed: `vm.builtin.make_shape` and `vm.builtin.make_prim_value`, each a packed call that
allocates an object. The same shape is often built several times in one run (every tensor of a
sequence's length, its storage and its view): nonzero_rows_tied built 14 shapes of which 8
differ, and 5 scalars of which 2 do.

A heap slot is written once per run, before any call that reads it, so two calls with the same
arguments give the same value. This pass, right after VMShapeLower, binds a repeated call's
variable to the first call's result where the first one dominates it (earlier in the same
sequence, or in a sequence enclosing the branch it is in); one in a sibling branch is built
again. Measured (session.run, the pass on and off in turns, one process, median of 9):
nonzero_rows_tied 6.18 -> 5.88 us at 3x4 and 6.25 -> 6.00 at 7x4, nonzero_gather 3.86 -> 3.77
us; models with fewer repeats within 1-2% (noise).
"""

from __future__ import annotations

import tvm
from tvm import relax

from .move_into_branches import Renamer

SHAPE_BUILTINS = ("vm.builtin.make_shape", "vm.builtin.make_prim_value")


@tvm.transform.module_pass(opt_level=0, name="tightfit.ReuseShapeValues")
class ReuseShapeValues:
    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        builder = relax.BlockBuilder(mod)
        for global_var, func in mod.functions.items():
            if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
                continue
            reused: dict[relax.Var, relax.Var] = {}
            body = _reuse(func.body, {}, reused)
            if reused:
                body = Renamer(reused).visit_expr(body)
                rewritten = relax.Function(func.params, body, func.ret_ty, func.is_pure,
                                           func.attrs, func.span)
                builder.update_func(global_var, builder.normalize(rewritten))
        return builder.get()


def _reuse(seq: relax.SeqExpr, built: dict, reused: dict) -> relax.SeqExpr:
    """`seq` without the calls `built` (key -> var of a dominating call) already made; each
    dropped call's var goes into `reused`, mapped to the var to use instead."""
    built = dict(built)  # what this sequence builds is not seen by its enclosing one's later code
    blocks = []
    for block in seq.blocks:
        bindings = []
        for binding in block.bindings:
            key = _key(binding)
            if key is not None and key in built:
                reused[binding.var] = built[key]
                continue
            if key is not None:
                built[key] = binding.var
            value = binding.value
            if isinstance(binding, relax.VarBinding) and isinstance(value, relax.If):
                binding = relax.VarBinding(binding.var, relax.If(
                    value.cond, _reuse(value.true_branch, built, reused),
                    _reuse(value.false_branch, built, reused)))
            bindings.append(binding)
        blocks.append(type(block)(bindings))
    return relax.SeqExpr(blocks, seq.body)


def _key(binding: relax.Binding) -> tuple | None:
    """What a shape builtin's binding builds: its function and arguments (the heap by
    identity, the rest by value); None for any other binding."""
    value = binding.value
    if not (isinstance(binding, relax.VarBinding) and isinstance(value, relax.Call)
            and isinstance(value.op, relax.ExternFunc) and value.op.global_symbol in SHAPE_BUILTINS):
        return None
    heap, *slots = value.args
    return (value.op.global_symbol, heap, tuple(str(slot) for slot in slots))
