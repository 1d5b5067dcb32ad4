"""Move the computations only one branch of an `If` uses into that branch.

SoD2 §2 and §3 (control-flow dynamism: `Switch` runs only the selected path; engines that run
every path and drop the unused results pay for it). TVM's ONNX importer emits every node of a
branch graph into the enclosing block and keeps only the branch's last node inside the `If`, so
a SkipNet-style gate still runs the convolutions it was meant to skip. This pass sinks each
binding whose value is pure and whose result is used, directly or through other sunk
bindings, by one branch of a later `If` in the same sequence and nowhere else, into the start
of that branch; `If`s inside branches get the same treatment, so nested gates skip their work
too.

It runs on the kernels as fused and scheduled (right after ToNonDataflow), so a sunk fused
kernel is the same kernel, and the memory plan that follows sees each branch's tensors inside
it; MoveIntoBranches applies the same rule before fusion, so that a branch's kernels fuse. Limits: a binding used by both branches stays before the `If` (sinking a copy into each
would grow code for no saving on either path); impure bindings never move.
"""

from __future__ import annotations

import tvm
from tvm import relax


def _uses(expr: relax.Expr) -> set[relax.Var]:
    return set(relax.analysis.free_vars(expr))


def _is_sinkable(binding: relax.Binding) -> bool:
    return (isinstance(binding, relax.VarBinding) and not isinstance(binding.value, relax.If)
            and not relax.analysis.contains_impure_call(binding.value))


def _sink_set(earlier: list[relax.Binding], branch_uses: set[relax.Var],
              other_uses: set[relax.Var]) -> set[relax.Var]:
    """The vars of `earlier` bindings to move into a branch: used there (directly or by
    others moved with them) and by nothing else. `other_uses` are the uses outside the
    branch: the other branch, the condition, and everything after the `If`. Walking back
    from the `If`, every user of a binding has been decided when it is reached."""
    used_outside = set(other_uses)
    used_inside = set(branch_uses)
    sunk: set[relax.Var] = set()
    for binding in reversed(earlier):
        if binding.var in used_inside and binding.var not in used_outside and _is_sinkable(binding):
            sunk.add(binding.var)
            used_inside |= _uses(binding.value)
        else:
            used_outside |= _uses(binding.value)
    return sunk


def sink_into_branches(seq: relax.SeqExpr) -> relax.SeqExpr:
    """`seq` with the bindings each branch alone uses moved into it (module docstring)."""
    bindings = [binding for block in seq.blocks for binding in block.bindings]
    for index, binding in enumerate(bindings):
        value = binding.value
        if not isinstance(binding, relax.VarBinding) or not isinstance(value, relax.If):
            continue
        earlier = bindings[:index]
        later = relax.SeqExpr([relax.BindingBlock(bindings[index + 1:])], seq.body)
        after = _uses(later) | _uses(value.cond)
        true_uses, false_uses = _uses(value.true_branch), _uses(value.false_branch)
        into_true = _sink_set(earlier, true_uses, after | false_uses)
        into_false = _sink_set(earlier, false_uses, after | true_uses)
        if not into_true and not into_false:
            continue
        branched = relax.If(value.cond,
                            _prepend(value.true_branch, [b for b in earlier if b.var in into_true]),
                            _prepend(value.false_branch, [b for b in earlier if b.var in into_false]))
        kept = [b for b in earlier if b.var not in into_true | into_false]
        rest = [relax.VarBinding(binding.var, branched), *bindings[index + 1:]]
        return sink_into_branches(relax.SeqExpr(_regroup(seq.blocks, kept + rest), seq.body))
    blocks = [type(block)([_rewrite_branches(binding) for binding in block.bindings])
              for block in seq.blocks]
    return relax.SeqExpr(blocks, seq.body)


def _rewrite_branches(binding: relax.Binding) -> relax.Binding:
    value = binding.value
    if not isinstance(value, relax.If):
        return binding
    return relax.VarBinding(binding.var, relax.If(value.cond, sink_into_branches(value.true_branch),
                                                  sink_into_branches(value.false_branch)))


def _prepend(branch: relax.SeqExpr, bindings: list[relax.Binding]) -> relax.SeqExpr:
    if not bindings:
        return branch
    return relax.SeqExpr([relax.BindingBlock(bindings), *branch.blocks], branch.body)


def _regroup(blocks: list[relax.BindingBlock], bindings: list[relax.Binding]) -> list:
    """`bindings` back in blocks of the original kinds, each binding in the block it came
    from (the `If`, rebuilt, in the block of the one it replaces)."""
    home = {}
    for number, block in enumerate(blocks):
        for binding in block.bindings:
            home[binding.var] = number
    grouped = [[] for _ in blocks]
    for binding in bindings:
        grouped[home[binding.var]].append(binding)
    return [type(block)(members) for block, members in zip(blocks, grouped) if members]


@tvm.transform.module_pass(opt_level=0, name="tightfit.SinkIntoBranches")
class SinkIntoBranches:
    """Rewrites every Relax function's `If`s as above."""

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        builder = relax.BlockBuilder(mod)
        for global_var, func in mod.functions.items():
            if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
                continue
            rewritten = relax.Function(func.params, sink_into_branches(func.body), func.ret_ty,
                                       func.is_pure, func.attrs, func.span)
            builder.update_func(global_var, builder.normalize(rewritten))
        return builder.get()
