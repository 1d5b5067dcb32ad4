"""Before fusion, move into the branches of an `If` what fusion can join to their kernels.

SoD2 §3 (control flow: `Switch` runs only the selected path) and §4.2 (fusion on dynamic
models). FuseOps fuses inside a dataflow block, and an `If` ends one: a gated block's last
kernel in a branch and the elementwise ops after the `If` that consume its result (a
residual add, an activation) stay separate kernels, each with its own allocation and pass
over memory. TVM's ONNX importer also leaves most of a branch's nodes before the `If`, so even
the branch's own conv and activation are in different blocks. This pass, on the kernels as
lowered and before FuseOps:
1. sinks each computation that only one branch uses into it (SinkIntoBranches' rule, which
   runs again after scheduling for what fusion leaves);
2. copies the bindings right after an `If` into both branches, while each is an elementwise,
   broadcast or injective kernel (`op_pattern` at most INJECTIVE) that uses the `If`'s
   result or a binding copied before it, and nothing after them uses the values they replace:
   the `If` then gives the last one's value;
3. makes each branch's bindings a dataflow block, so that FuseOps fuses them.
TVM 0.27's FuseOps skips dataflow blocks inside an `If`, so each branch is also outlined into
a private function for FuseOps to fuse, which InlineBranchFunctions puts back after FuseTIR.
Functions without an `If` are left as they are. A copy costs code in the other branch, never
work: only one branch runs. On the zoo's gated_skip_block, conv + bias + ReLU + residual add
become one kernel and scale + add another: session.run 6.77 -> 5.98 us at 2x8x16x16 (conv
branch), 3.07 -> 2.67 us at 1x8x16x16 and 3.66 -> 3.00 at 3x8x16x16 (scale branch); the other
zoo models with an `If` within 1% (one process, the pass on and off in turns, median of 9).
"""

from __future__ import annotations

import tvm
from tvm import relax

from .sink_into_branches import sink_into_branches

# TVM's op patterns (relax/op_attr_types.h): elementwise 0, broadcast 1, injective 2
INJECTIVE = 2


@tvm.transform.module_pass(opt_level=0, name="tightfit.MoveIntoBranches")
class MoveIntoBranches:
    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        for global_var, func in list(mod.functions.items()):
            if not isinstance(func, relax.Function) or not _has_if(func):
                continue
            plain = relax.transform.ToNonDataflow()(mod)[global_var]
            body = _copy_tails_into_branches(sink_into_branches(plain.body), mod)
            moved = relax.Function(plain.params, body, plain.ret_ty, plain.is_pure, plain.attrs,
                                   plain.span)
            builder = relax.BlockBuilder(mod)
            moved = _outline_branches(moved, builder)
            builder.update_func(global_var, builder.normalize(moved))
            mod = builder.get()
        # single bindings too: a branch may hold one kernel and one copied op
        return relax.transform.ConvertToDataflow(min_size=1)(mod)


def _has_if(func: relax.Function) -> bool:
    found = []
    relax.analysis.post_order_visit(
        func.body, lambda node: found.append(node) if isinstance(node, relax.If) else None)
    return bool(found)


def _copy_tails_into_branches(seq: relax.SeqExpr, mod: tvm.IRModule) -> relax.SeqExpr:
    bindings = [binding for block in seq.blocks for binding in block.bindings]
    rewritten: list[relax.Binding] = []
    index = 0
    while index < len(bindings):
        binding = bindings[index]
        if not (isinstance(binding, relax.VarBinding) and isinstance(binding.value, relax.If)):
            rewritten.append(binding)
            index += 1
            continue
        branched = relax.If(binding.value.cond,
                            _copy_tails_into_branches(binding.value.true_branch, mod),
                            _copy_tails_into_branches(binding.value.false_branch, mod))
        tail = _movable_tail(binding.var, bindings[index + 1:], seq.body, mod)
        if not tail:
            rewritten.append(relax.VarBinding(binding.var, branched))
            index += 1
            continue
        rewritten.append(relax.VarBinding(tail[-1].var, relax.If(
            branched.cond, _with_tail(branched.true_branch, binding.var, tail, "then"),
            _with_tail(branched.false_branch, binding.var, tail, "else"))))
        index += 1 + len(tail)
    return relax.SeqExpr([relax.BindingBlock(rewritten)], seq.body)


def _movable_tail(if_var: relax.Var, after: list[relax.Binding], body: relax.Expr,
                  mod: tvm.IRModule) -> list[relax.VarBinding]:
    """The longest run of bindings at the start of `after` that step 2 of the module docstring
    may copy into the branches."""
    run: list[relax.VarBinding] = []
    produced = {if_var}
    for binding in after:
        if not (isinstance(binding, relax.VarBinding) and _is_injective_kernel(binding.value, mod)
                and produced & set(relax.analysis.free_vars(binding.value))):
            break
        run.append(binding)
        produced.add(binding.var)
    while run:
        replaced = {if_var} | {binding.var for binding in run[:-1]}
        rest = relax.SeqExpr([relax.BindingBlock(after[len(run):])], body)
        if not replaced & set(relax.analysis.free_vars(rest)):
            return run
        run.pop()
    return run


def _is_injective_kernel(value: relax.Expr, mod: tvm.IRModule) -> bool:
    if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
            and value.op.name == "relax.call_tir"):
        return False
    kernel = mod[value.args[0]]
    pattern = (kernel.attrs or {}).get("op_pattern")
    return pattern is not None and int(pattern) <= INJECTIVE


def _with_tail(branch: relax.SeqExpr, if_var: relax.Var, tail: list[relax.VarBinding],
               tag: str) -> relax.SeqExpr:
    """`branch` followed by a copy of `tail` over its result, with vars of its own."""
    renamer = Renamer({if_var: branch.body})
    copies = []
    for binding in tail:
        value = renamer.visit_expr(binding.value)
        copy = relax.Var(f"{binding.var.name}_{tag}", binding.var.ty)
        renamer.mapping[binding.var] = copy
        copies.append(relax.VarBinding(copy, value))
    return relax.SeqExpr([*branch.blocks, relax.BindingBlock(copies)], copies[-1].var)


@relax.expr_functor.mutator
class Renamer(relax.PyExprMutator):
    """An expression with the vars in `mapping` replaced by their values there."""

    def __init__(self, mapping: dict):
        super().__init__()
        self.mapping = mapping

    def visit_var_(self, var: relax.Var) -> relax.Expr:
        if var in self.mapping:
            return self.mapping[var]
        return super().visit_var_(var)  # a var this mutator bound anew

    def visit_dataflow_var_(self, var: relax.DataflowVar) -> relax.Expr:
        if var in self.mapping:
            return self.mapping[var]
        return super().visit_dataflow_var_(var)


def _outline_branches(func: relax.Function, builder: relax.BlockBuilder) -> relax.Function:
    """`func` with each branch of two or more bindings and no `If` of its own made a call of a
    private function of those bindings: TVM 0.27's FuseOps fuses the dataflow blocks of every
    function but skips those inside an `If` (apache/tvm#17033). InlineBranchFunctions, after
    FuseTIR, puts the fused bindings back in the branch. A branch holding an `If` stays as it
    is (its kernels unfused), the branches of that `If` are outlined in turn."""

    def outlined(branch: relax.SeqExpr) -> relax.SeqExpr:
        bindings = [binding for block in branch.blocks for binding in block.bindings]
        if any(isinstance(binding.value, relax.If) for binding in bindings):
            return with_branches(branch, outlined)
        if len(bindings) < 2:
            return branch
        inputs = relax.analysis.free_vars(branch)
        params = [relax.Var(var.name, var.ty) for var in inputs]
        body = Renamer(dict(zip(inputs, params))).visit_expr(branch)
        function = relax.Function(params, body, branch.body.ty, is_pure=True).with_attr(
            BRANCH_ATTR, True)
        if relax.analysis.free_symbolic_vars(function):
            return branch  # a dim the branch uses is not one of its inputs'
        callee = builder.add_func(function, BRANCH_FUNCTION)
        result = relax.Var("branch_result", branch.body.ty)
        call = relax.Call(callee, list(inputs))
        return relax.SeqExpr([relax.BindingBlock([relax.VarBinding(result, call)])], result)

    return relax.Function(func.params, with_branches(func.body, outlined), func.ret_ty,
                          func.is_pure, func.attrs, func.span)


BRANCH_FUNCTION = "branch"
# marks the functions `_outline_branches` makes, for InlineBranchFunctions
BRANCH_ATTR = "tightfit.branch"


def with_branches(seq: relax.SeqExpr, rewrite) -> relax.SeqExpr:
    """`seq` with `rewrite` applied to both branches of each of its `If`s."""
    blocks = []
    for block in seq.blocks:
        bindings = []
        for binding in block.bindings:
            if isinstance(binding, relax.VarBinding) and isinstance(binding.value, relax.If):
                binding = relax.VarBinding(binding.var, relax.If(
                    binding.value.cond, rewrite(binding.value.true_branch),
                    rewrite(binding.value.false_branch)))
            bindings.append(binding)
        blocks.append(type(block)(bindings))
    return relax.SeqExpr(blocks, seq.body)
