"""End a dataflow block where a `match_cast` binds a dim computed in it, so that no fused kernel
both computes a dim and uses it (SoD2 §4.2: a fusion plan must respect the order in which
execution-determined dims become known).

A dim known only from values (a Range's length, a window's size fed as a tensor, the count of
NonZero) is bound by `match_cast(tensor_to_shape(t), R.Shape([n]))`, after the kernels that
compute `t`. TVM's FuseOps fuses along dataflow edges without looking at dims: a kernel over
`[n]` fused with a kernel that computes `t` is one call that must run before the `match_cast`
(it produces `t`) and after it (it needs `n`), and VMShapeLower then fails ("PrimExpr 4 * n ...
has not been computed"): ONNX's HannWindow, HammingWindow and BlackmanWindow bodies, whose
arange takes the size input. FuseOps fuses within a dataflow block only, so this pass ends the
block after each `match_cast` that binds a new dim; a value the later blocks read becomes a
block output (a `Var`). Blocks with no such `match_cast` are kept as they are.
"""

from __future__ import annotations

import tvm
from tvm import relax

from .move_into_branches import Renamer


def _segments(block: relax.DataflowBlock, bound: set) -> list[list]:
    """The block's bindings cut after each match_cast binding a dim not in `bound` (updated)."""
    segments = [[]]
    for binding in block.bindings:
        segments[-1].append(binding)
        if isinstance(binding, relax.MatchCast):
            new_dims = set(relax.analysis.definable_tir_vars_in_type(binding.ty)) - bound
            bound |= new_dims
            if new_dims:
                segments.append([])
    return [segment for segment in segments if segment]


def _split(block: relax.DataflowBlock, bound: set) -> list[relax.DataflowBlock]:
    segments = _segments(block, bound)
    if len(segments) == 1:
        return [block]
    read_later = [set() for _ in segments]
    for index in range(len(segments) - 2, -1, -1):
        read_later[index] = read_later[index + 1] | {
            var for binding in segments[index + 1] for var in relax.analysis.free_vars(binding.value)}
    renamed = {binding.var: relax.Var(binding.var.name, binding.var.ty)
               for index, segment in enumerate(segments) for binding in segment
               if isinstance(binding.var, relax.DataflowVar) and binding.var in read_later[index]}
    renamer = Renamer(renamed)
    blocks = []
    for segment in segments:
        bindings = []
        for binding in segment:
            var, value = renamed.get(binding.var, binding.var), renamer.visit_expr(binding.value)
            bindings.append(relax.MatchCast(var, value, binding.ty) if isinstance(binding, relax.MatchCast)
                            else relax.VarBinding(var, value))
        blocks.append(relax.DataflowBlock(bindings))
    return blocks


def _split_function(func: relax.Function) -> relax.Function:
    bound = {dim for param in func.params for dim in relax.analysis.definable_tir_vars_in_type(param.ty)}
    blocks = []
    for block in func.body.blocks:
        if isinstance(block, relax.DataflowBlock):
            blocks.extend(_split(block, bound))
        else:
            bound |= {dim for binding in block.bindings if isinstance(binding, relax.MatchCast)
                      for dim in relax.analysis.definable_tir_vars_in_type(binding.ty)}
            blocks.append(block)
    if len(blocks) == len(func.body.blocks):
        return func
    return relax.Function(func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty,
                          func.is_pure, func.attrs)


@tvm.transform.module_pass(opt_level=0, name="tightfit.SplitBlocksWhereDimsAreBound")
class SplitBlocksWhereDimsAreBound:
    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        updated = mod.clone()
        for global_var, func in mod.functions.items():
            if isinstance(func, relax.Function):
                updated[global_var] = _split_function(func)
        return updated
