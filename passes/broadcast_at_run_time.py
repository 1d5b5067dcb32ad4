"""Broadcast at run time the elementwise ops whose shape nothing could infer.

SoD2 §3 and §4.1: an op whose output shape depends on values known only when the model runs
(ISVDOS) binds fresh symbols for its dims, and an elementwise op that then combines such a
tensor with another has operand dims no one can prove equal or 1: a reduction over run-time
axes (a dim is 1 where it reduces, the input's elsewhere) divided into its input, for one.
Relax infers no shape there and RDP (which runs before this pass) proves none; legalization
skips an op of unknown shape, and code generation then failed ("CodeGenVM cannot emit this
Relax operator directly").

Each such op is rebuilt on its operands broadcast to the shape numpy's rules give when the
model runs: dim by dim, the first operand dim that is not 1 (operands padded with leading 1s
to one rank), bound to fresh symbols. The broadcast reads index 0 along a dim of extent 1,
tested at run time (TOPI's broadcast_to reads a dim it cannot prove to be 1 as a full one). As
in onnxruntime's and numpy's broadcasting, operands must agree where neither dim is 1; an input
that breaks this is invalid, and the result is then undefined rather than an error.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te, tirx

# Elementwise ops whose operands Relax broadcasts by numpy's rules.
BROADCASTING_OPS = frozenset(f"relax.{name}" for name in (
    "add", "subtract", "multiply", "divide", "floor_divide", "power", "mod", "floor_mod",
    "maximum", "minimum", "equal", "not_equal", "less", "less_equal", "greater", "greater_equal",
    "logical_and", "logical_or", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor", "where"))


def _unresolved_broadcast(call: relax.Call) -> bool:
    """A broadcasting op over operands of known shapes whose own shape is unknown."""
    return (isinstance(call.op, tvm.ir.Op) and call.op.name in BROADCASTING_OPS
            and isinstance(call.ty, relax.TensorType) and call.ty.shape is None
            and all(isinstance(arg.ty, relax.TensorType) and arg.ty.shape is not None
                    for arg in call.args))


def _broadcast_to(tensor: te.Tensor, dims: list) -> te.Tensor:
    offset = len(dims) - len(tensor.shape)
    return te.compute(dims, lambda *index: tensor(*[
        tirx.if_then_else(extent == 1, tirx.const(0, "int64"), position)
        for position, extent in zip(index[offset:], tensor.shape)]), name="broadcast_at_run_time")


@relax.expr_functor.mutator
class _Broadcaster(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if not _unresolved_broadcast(call):
            return call
        emit = self.builder_.emit
        rank = max(arg.ty.ndim for arg in call.args)
        shape = None
        for operand in call.args:
            dims = emit(relax.op.shape_to_tensor(relax.op.shape_of(operand)))
            if operand.ty.ndim < rank:
                # relax.const makes an int64 array int32 unless told
                ones = relax.const(np.ones(rank - operand.ty.ndim, np.int64), "int64")
                dims = emit(relax.op.concat([ones, dims], axis=0))
            shape = dims if shape is None else emit(
                relax.op.where(relax.op.equal(shape, relax.const(1, "int64")), dims, shape))
        symbols = [tirx.Var(f"broadcast_dim{axis}", "int64") for axis in range(rank)]
        self.builder_.match_cast(emit(relax.op.tensor_to_shape(shape)), relax.ShapeType(symbols))
        operands = [self.builder_.call_te(_broadcast_to, operand, symbols,
                                          primfunc_name_hint="broadcast_at_run_time")
                    for operand in call.args]
        return relax.Call(call.op, [emit(operand) for operand in operands], call.attrs, call.ty_args)


@tvm.transform.module_pass(opt_level=0, name="tightfit.BroadcastAtRunTime")
class BroadcastAtRunTime:
    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        broadcaster = _Broadcaster(mod)
        for global_var, func in list(mod.functions.items()):
            if isinstance(func, relax.Function):
                broadcaster.builder_.update_func(global_var, broadcaster.visit_expr(func))
        return broadcaster.builder_.get()
