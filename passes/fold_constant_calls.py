"""Fold the calls whose arguments are all constants with TVM's FoldConstant, one call at a time.

SoD2 §4.1: the concrete part of RDP's constant propagation, for the calls numpy does not fold
exactly (fold_constants_on_host.py) and for kernels (`call_tir`) on constants.

TVM's FoldConstant legalizes every operator call it meets to see whether the kernel it becomes
can be evaluated, constant arguments or not, and keeps the call as it was when they are not.
A call whose shapes are not known yet (before RDP: the products and concats of a function body
whose intermediate dims the exporter left unrelated, the matmuls of ONNX's expanded Attention)
has no kernel, and its legalizer raises ("'NoneType' object is not iterable", "emit_te now only
supports Tensor that has ShapeExpr shape"): FoldConstant fails and the compile with it.
LegalizeOps skips such calls; FoldConstant does not.

This pass shows FoldConstant only what it can fold: each call (an operator's, or a kernel's
`call_tir`) whose arguments are all constants, alone in a module with the kernel it calls, and
binds the constant it evaluates to in the call's place. A call numpy computes exactly is folded
with numpy instead (fold_constants_on_host.py): this pass's folds feed calls that pass did not
see on constants, and compiling each would take tens of ms (in ONNX's expanded Attention, a
`take` of a folded `scatter_elements` feeds a `maximum`, an `add` and a `negative`). A binding
to a constant is replaced at each of its uses, so chains fold in one walk. FoldConstant folds
the same calls as over the whole module, with its own rules (what it declines to fold stays a
call), except a call with no arguments at all (after legalization, the kernel of an arange or an
identity matrix), which stays a call: over the whole module FoldConstant stored its output in
the package.
"""

from __future__ import annotations

import tvm
from tvm import relax

from ..schedules import legalize_as_onnx
from .fold_constants_on_host import fold_on_host

CALL_TIR = "relax.call_tir"
# a fold computes what the compiled model would: with tightfit's kernels where TVM's differ
ONNX_KERNELS = legalize_as_onnx()


@relax.expr_functor.mutator
class _ConstantCallFolder(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.mod = mod
        # uses of a variable: the constant bound to it, or its variable of a more precise type
        self.replaced: dict[relax.Var, relax.Expr] = {}
        self.shapes: dict[relax.Var, relax.ShapeExpr] = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = self.visit_expr(binding.value)
        if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
            # a shape argument as the shape it is bound to, as FoldConstant passes it
            arguments = [self.shapes.get(argument, argument) for argument in value.args]
            if any(not new.same_as(old) for new, old in zip(arguments, value.args)):
                value = self.builder_.normalize(relax.Call(value.op, arguments, value.attrs, value.ty_args))
            if _all_arguments_constant(value):
                value = fold_on_host(value) or self._fold(value) or value
        if isinstance(value, relax.ShapeExpr):
            self.shapes[binding.var] = value
        # a value whose type is now more precise (a shape argument replaced by the shape it was
        # bound to) gets a variable of that type, as TVM's own mutators give it
        var = self.with_type(binding.var, value.ty)
        if isinstance(value, tvm.ir.GenericConst):  # uses take the constant, as FoldConstant's do
            self.replaced[binding.var] = value
        elif not var.same_as(binding.var):
            self.replaced[binding.var] = var
        # the binding stays until remove_all_unused sees that every use took the constant
        self.builder_.emit_normalized(relax.VarBinding(var, value))

    def visit_var_(self, var: relax.Var) -> relax.Expr:
        return self.replaced.get(var, var)

    def visit_dataflow_var_(self, var: relax.Var) -> relax.Expr:
        return self.visit_var_(var)

    def _fold(self, call: relax.Call) -> relax.Expr | None:
        kernels = {call.args[0]: self.mod[call.args[0]]} if _is_call_tir(call) else {}
        builder = relax.BlockBuilder(tvm.IRModule(kernels))
        with builder.function("main", []):
            with builder.dataflow():  # FoldConstant folds in dataflow blocks only
                value = builder.emit_output(call)
            builder.emit_func_output(value)
        mod = builder.get()
        if not _is_call_tir(call) and call.op.name in ONNX_KERNELS:
            mod = relax.transform.LegalizeOps(ONNX_KERNELS)(mod)
        folded = relax.transform.FoldConstant()(mod)["main"].body.body
        return folded if isinstance(folded, tvm.ir.GenericConst) else None


def _is_call_tir(call: relax.Call) -> bool:
    return isinstance(call.op, tvm.ir.Op) and call.op.name == CALL_TIR


def _all_arguments_constant(call: relax.Call) -> bool:
    if not isinstance(call.op, tvm.ir.Op):
        return False
    arguments = call.args[1].fields if _is_call_tir(call) else call.args
    if _is_call_tir(call) and len(call.args) > 2:
        arguments = [*arguments, call.args[2]]
    return bool(arguments) and all(_is_constant(argument) for argument in arguments)


def _is_constant(expr: relax.Expr) -> bool:
    if isinstance(expr, relax.Tuple):
        return all(_is_constant(field) for field in expr.fields)
    if isinstance(expr, relax.ShapeExpr):
        return all(isinstance(value, tvm.tirx.IntImm) for value in expr.values)
    return isinstance(expr, (tvm.ir.GenericConst, tvm.ir.StringImm, tvm.tirx.IntImm, tvm.tirx.FloatImm))


@tvm.transform.module_pass(opt_level=0, name="tightfit.FoldConstantCalls")
class FoldConstantCalls:
    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        updated = mod.clone()
        for global_var, func in mod.functions.items():
            if isinstance(func, relax.Function):
                folded = _ConstantCallFolder(mod).visit_expr(func)
                updated[global_var] = relax.analysis.remove_all_unused(folded)
        return updated
