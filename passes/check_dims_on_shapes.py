"""A match_cast that only checks a tensor's dims checks them on a shape value, as soon as they
are known, and the tensor goes on as it is.

SoD2 §4.1: RDP finds dims that must be equal for the graph to run where its types do not say
so (NonZero's count and the rows it is multiplied with; `(h - 1) // 4 * 2 + 2` and
`(h - 1) // 2 + 1`, two feature maps a detector adds), and writes each as a match_cast of the
tensor to the tighter type, which the run checks. TVM's VM checks a tensor's match_cast on the
tensor itself, so a tensor a kernel writes had to be an allocation the VM sees, and a kernel
sequence (launch_kernel_sequences.py) ended there: the VM allocated the tensor and its storage,
called the sequence up to it, checked it, and called the rest. The check needs only the dims:
here it becomes a match_cast of the shape value the tensor has by its type
(`R.shape([1, nonzero_count])` to `R.Shape([1, rows])`), placed right after the binding that
defines the last of its dims (at the start of its block when none does), and the tensor is
bound on as it is, its var keeping the type the check established. Dims the arithmetic
analyzer proves equal need no check. A failing check still raises the VM's match_cast error
(Session reads it as an InputError), now before any kernel that relies on it has run.

Measured, the VM call alone, both builds in one process in alternating turns, median of 31:
speech_encoder_dynamo at 1x40x40 12.05 -> 9.58 us (one sequence instead of three), at 2x77x40
31.3 -> 28.7 us; nonzero_rows_tied at 3x4 2.61 -> 2.09 us; detector_fpn at 1x3x32x48 27.97 ->
26.70 us.

Limits: only a match_cast of a tensor whose type has a shape, to a type of the same dtype and
rank that defines no new dim; one defining a dim (a count read back) is left as it is. The
pass runs after ToNonDataflow: the vars and blocks it makes are not dataflow ones.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx

from .launch_kernel_sequences import with_branches_rewritten


@tvm.transform.module_pass(opt_level=0, name="tightfit.CheckDimsOnShapes")
class CheckDimsOnShapes:
    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        builder = relax.BlockBuilder(mod)
        for global_var, func in list(mod.functions.items()):
            if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
                continue
            known = {var for param in func.params
                     for var in relax.analysis.definable_tir_vars_in_type(param.ty)}
            body = _rewrite_seq(func.body, known, builder)
            if body.same_as(func.body):
                continue
            builder.update_func(global_var, builder.normalize(relax.Function(
                func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span)))
        return builder.finalize()


def _rewrite_seq(seq: relax.SeqExpr, known: set, builder: relax.BlockBuilder) -> relax.SeqExpr:
    """`seq` with its tensors' dim checks on shapes, in branches too; `known`: the dims defined
    before it."""
    blocks, changed = [], False
    for block in seq.blocks:
        bindings, known = _rewrite_block(list(block.bindings), known, builder)
        changed |= len(bindings) != len(block.bindings) or any(
            not new.same_as(old) for new, old in zip(bindings, block.bindings))
        blocks.append(relax.BindingBlock(bindings))
    return relax.SeqExpr(blocks, seq.body) if changed else seq


def _rewrite_block(bindings: list[relax.Binding], known: set,
                   builder: relax.BlockBuilder) -> tuple[list[relax.Binding], set]:
    """The block's bindings, each check on a tensor split into a check on its shape, moved up
    to where its dims are known, and the tensor's binding; and the dims known after it."""
    known = set(known)
    # where each dim this block defines is defined (the index of its match_cast)
    defined_at: dict[tirx.Var, int] = {}
    checks_after: dict[int, list[relax.Binding]] = {}
    rewritten = []
    for index, binding in enumerate(bindings):
        binding = with_branches_rewritten(binding, lambda branch: _rewrite_seq(branch, known, builder),
                                          builder)
        if _is_dim_check(binding, known) and _proven_equal(binding.value.ty, binding.ty):
            binding = relax.VarBinding(binding.var, binding.value)
        elif _is_dim_check(binding, known):
            dims = _dims_of(binding.value.ty) | _dims_of(binding.ty)
            after = max([defined_at[dim] for dim in dims if dim in defined_at], default=-1)
            # VMShapeLower computes a shape's dims for a binding of it, not inside a match_cast
            have = relax.Var(binding.var.name + "_dims", binding.value.ty.shape.ty)
            checked = relax.Var(binding.var.name + "_checked_dims", binding.ty.shape.ty)
            checks_after.setdefault(after, []).extend([
                relax.VarBinding(have, binding.value.ty.shape),
                relax.MatchCast(checked, have, binding.ty.shape.ty)])
            binding = relax.VarBinding(binding.var, binding.value)
        elif isinstance(binding, relax.MatchCast):
            for dim in relax.analysis.definable_tir_vars_in_type(binding.ty):
                if dim not in known:
                    defined_at[dim] = index
                    known.add(dim)
        rewritten.append(binding)
    placed = checks_after.get(-1, [])
    for index, binding in enumerate(rewritten):
        placed.append(binding)
        placed += checks_after.get(index, [])
    return placed, known


def _is_dim_check(binding: relax.Binding, known: set) -> bool:
    """Is `binding` a match_cast of a tensor with a shape to a type of the same dtype and rank
    whose dims are all known already?"""
    if not isinstance(binding, relax.MatchCast) or not isinstance(binding.value, relax.Var):
        return False
    have, want = binding.value.ty, binding.ty
    return (isinstance(have, relax.TensorType) and isinstance(want, relax.TensorType)
            and have.shape is not None and want.shape is not None
            and isinstance(have.shape, relax.ShapeExpr) and isinstance(want.shape, relax.ShapeExpr)
            and str(have.dtype) == str(want.dtype) and have.ndim == want.ndim
            and _dims_of(want) <= known)


def _proven_equal(have: relax.TensorType, want: relax.TensorType) -> bool:
    analyzer = tvm.sym.Analyzer()
    return all(analyzer.can_prove_equal(a, b) for a, b in zip(have.shape.values, want.shape.values))


def _dims_of(ty: relax.TensorType) -> set:
    return set(relax.analysis.tir_vars_in_type(ty))
