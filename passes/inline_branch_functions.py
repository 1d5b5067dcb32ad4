"""Put the branches MoveIntoBranches outlined back into their `If`s, as fused.

The second half of passes/move_into_branches.py (SoD2 §3, §4.2), after FuseOps and FuseTIR:
each call of a function MoveIntoBranches outlined becomes that function's bindings, its params
replaced by the call's arguments; the functions go. TVM's InlinePrivateFunctions does the same
but gives the inlined body symbolic dims of its own (`batch_1` for the caller's `batch`), which
nothing then defines; an outlined function's params have the caller's types, so its body is the
caller's code as it is.
"""

from __future__ import annotations

import tvm
from tvm import relax

from .move_into_branches import BRANCH_ATTR, Renamer, with_branches


@tvm.transform.module_pass(opt_level=0, name="tightfit.InlineBranchFunctions")
class InlineBranchFunctions:
    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        outlined = {global_var: func for global_var, func in mod.functions.items()
                    if isinstance(func, relax.Function) and _is_outlined(func)}
        if not outlined:
            return mod
        plain = relax.transform.ToNonDataflow()(mod)

        def inlined(branch: relax.SeqExpr) -> relax.SeqExpr:
            bindings = []
            for binding in (binding for block in branch.blocks for binding in block.bindings):
                call = binding.value
                if isinstance(call, relax.Call) and call.op in outlined:
                    callee = plain[call.op]
                    body = Renamer(dict(zip(callee.params, call.args))).visit_expr(callee.body)
                    bindings += [b for block in body.blocks for b in block.bindings]
                    bindings.append(relax.VarBinding(binding.var, body.body))
                else:
                    bindings.append(binding)
            return with_branches(relax.SeqExpr([relax.BindingBlock(bindings)], branch.body), inlined)

        builder = relax.BlockBuilder(mod)
        for global_var, func in plain.functions.items():
            if isinstance(func, relax.Function) and global_var not in outlined and _calls_any(func, outlined):
                rewritten = relax.Function(func.params, with_branches(func.body, inlined),
                                           func.ret_ty, func.is_pure, func.attrs, func.span)
                builder.update_func(global_var, builder.normalize(rewritten))
        mod = builder.get()
        for global_var in outlined:
            del mod[global_var]
        # the branches' bindings back in dataflow blocks, single ones too (as MoveIntoBranches
        # left them), for the passes that rewrite inside dataflow blocks only
        return relax.transform.ConvertToDataflow(min_size=1)(mod)


def _is_outlined(func: relax.Function) -> bool:
    return bool((func.attrs or {}).get(BRANCH_ATTR, False))


def _calls_any(func: relax.Function, callees: dict) -> bool:
    found = []
    relax.analysis.post_order_visit(func.body, lambda node: found.append(node) if (
        isinstance(node, relax.Call) and node.op in callees) else None)
    return bool(found)
