"""Reshapes stay views of their input: a reshape kernel left alone by fusion becomes the VM's
reshape, whatever its dims.

SoD2 §3: a reshape, a flatten, a squeeze or an expand_dims relabels its input's elements (RDP
propagates only its shape); Relax tensors are contiguous, so it never needs a copy. TVM turns a
standalone reshape kernel back into a view (RewriteDataflowReshape) only where it can prove
that the kernel's index arithmetic is a reshape, and with symbolic dims it often cannot: on
ShuffleNet's channel shuffle over a dynamic H x W the source index is
`((n*30 + c)*H*W + x) // W // H // 30 % batch, ...`, and the copy, several divisions by
symbolic extents per element, took 257 us per call at 30 x 24 x 24 (a view: nothing).
So LegalizeOps marks the kernels these ops become (`legalize_views`, its customize map), and
this pass, after fusion, makes every call of a marked kernel a `relax.op.reshape` of the call's
tensor to the call's output shape. A reshape that FuseOps put into a kernel with other ops is no
longer a call of a marked kernel, and stays in that kernel.
"""

from __future__ import annotations

import tvm
from tvm import relax

VIEW_KERNEL_ATTR = "tightfit.view"
VIEW_OPS = ("relax.reshape", "relax.flatten", "relax.squeeze", "relax.expand_dims")


def legalize_views() -> dict:
    """LegalizeOps' customize map: each view op legalized as TVM does, its kernel marked with
    the op's name."""
    return {name: _marking(name, tvm.ir.Op.get(name).get_attr("FLegalize")) for name in VIEW_OPS}


def _marking(op_name: str, legalize):
    def legalize_and_mark(builder: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        legalized = legalize(builder, call)
        if _is_call_tir(legalized):
            kernel = legalized.args[0]
            builder.update_func(kernel,
                                builder.get()[kernel].with_attr(VIEW_KERNEL_ATTR, op_name))
        return legalized

    return legalize_and_mark


def _is_call_tir(expr: relax.Expr) -> bool:
    return isinstance(expr, relax.Call) and expr.op.same_as(tvm.ir.Op.get("relax.call_tir"))


@relax.expr_functor.mutator
class _ViewRewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.mod = mod

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not _is_call_tir(call):
            return call
        kernel = self.mod[call.args[0]]
        if kernel.attrs is None or VIEW_KERNEL_ATTR not in kernel.attrs:
            return call
        # the tensor is the kernel's first argument; any others are the symbolic dims it reads
        return relax.op.reshape(call.args[1].fields[0], call.ty.shape)


@tvm.transform.module_pass(opt_level=0, name="tightfit.KeepReshapesAsViews")
class KeepReshapesAsViews:
    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        rewriter = _ViewRewriter(mod)
        for global_var, func in list(mod.functions.items()):
            if isinstance(func, relax.Function):
                mod[global_var] = rewriter.visit_expr(func)
        return mod
