"""Fold inference batch norms into the convolutions they follow.

MNN's model conversion (§3.1, graph optimization before pre-inference) and FlexNN's offline
weight pre-transformation: `batch_norm(conv(x, W) [+ b])` with known statistics is the conv
`conv(x, W * s) + (beta + (b - mean) * s)`, s = gamma / sqrt(var + eps) per output channel.
Left unfolded, every output element pays a subtract, a divide, a multiply and an add, with four
per-channel vectors to read, in the conv's epilogue (a tenth of a 3x3 conv's time at 16
channels). The new weight and shift are computed from weights alone, so PreTransformWeights
computes them at compile time and only the folded weight is stored.
Limits: conv1d/conv2d with NCW/NCHW data and OIW/OIHW weights, batch norm over axis 1 in
inference mode (`training=False`), the conv's result used only by the bias add or batch norm,
and the conv weight, bias and statistics known at compile time (weights or constants).
"""

from __future__ import annotations

import tvm
from tvm import relax

from ..schedules.kernel_call import WeightOnly

CONVS = {"relax.nn.conv1d": "NCW", "relax.nn.conv2d": "NCHW"}


@relax.expr_functor.mutator
class _BatchNormFolder(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, func: relax.Function):
        super().__init__(mod)
        self.weight_only = WeightOnly(func)
        self.values = {binding.var: binding.value for block in func.body.blocks
                       for binding in block.bindings if isinstance(binding, relax.VarBinding)}
        self.uses = _use_counts(func)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        folded = self._fold(binding.value)
        if folded is None:
            super().visit_var_binding_(binding)
            return
        # a var the dataflow block exports must stay visible after the block
        emit = self.builder_.emit if isinstance(binding.var, relax.DataflowVar) else self.builder_.emit_output
        self.set_var_remap(binding.var, emit(folded, name_hint=binding.var.name))

    def _fold(self, value: relax.Expr) -> relax.Expr | None:
        """The folded conv for `bn[0]` of a batch norm after a conv (and bias), else None."""
        if not isinstance(value, relax.TupleGetItem) or value.index != 0:
            return None
        norm = self.values.get(value.tuple_value)
        if not _is_inference_batch_norm(norm) or not all(self.weight_only(arg) for arg in norm.args[1:]):
            return None
        conv, bias = self._conv_and_bias(norm.args[0])
        if conv is None:
            return None
        data, weight = (self.visit_expr(arg) for arg in conv.args)
        gamma, beta, mean, variance = (self.visit_expr(arg) for arg in norm.args[1:])
        channels = int(weight.ty.shape.values[0])
        emit = self.builder_.emit
        epsilon = relax.const(float(norm.attrs.epsilon), "float32")
        scale = emit(relax.op.divide(gamma, relax.op.sqrt(relax.op.add(variance, epsilon))))
        kernel_ndim = len(weight.ty.shape.values)
        folded_weight = emit(relax.op.multiply(
            weight, relax.op.reshape(scale, [channels] + [1] * (kernel_ndim - 1))))
        centre = mean if bias is None else relax.op.subtract(mean, relax.op.reshape(self.visit_expr(bias), [channels]))
        shift = emit(relax.op.subtract(beta, relax.op.multiply(centre, scale)))
        convolved = emit(relax.Call(conv.op, [data, folded_weight], conv.attrs))
        return relax.op.add(convolved, relax.op.reshape(shift, [1, channels] + [1] * (kernel_ndim - 2)))

    def _conv_and_bias(self, expr: relax.Expr) -> tuple[relax.Call | None, relax.Expr | None]:
        """(conv, per-channel bias or None) when `expr` is conv(x, W) or conv(x, W) + b."""
        value = self.values.get(expr)
        bias = None
        if _is_op(value, "relax.add") and self.uses.get(expr, 0) == 1:
            candidate, bias = value.args
            if not (self.weight_only(bias) and _is_channel_vector(bias, candidate)):
                return None, None
            expr, value = candidate, self.values.get(candidate)
        if not _is_foldable_conv(value) or self.uses.get(expr, 0) != 1 or not self.weight_only(value.args[1]):
            return None, None
        return value, bias


@tvm.transform.module_pass(opt_level=0, name="tightfit.FoldBatchNorm")
class FoldBatchNorm:
    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        updated = mod.clone()
        for global_var, func in mod.functions.items():
            if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
                continue
            folder = _BatchNormFolder(mod, func)
            folded = folder.visit_expr(func)
            # the batch norms' other outputs (running statistics) are never used in inference
            updated[global_var] = relax.analysis.remove_all_unused(folded)
        return updated


def _is_op(value, name: str) -> bool:
    return isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == name


def _is_inference_batch_norm(value) -> bool:
    return (_is_op(value, "relax.nn.batch_norm") and int(value.attrs.axis) == 1
            and not bool(value.attrs.training))


def _is_foldable_conv(value) -> bool:
    if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op) or value.op.name not in CONVS:
        return False
    layout = CONVS[value.op.name]
    attrs = value.attrs
    weight_ty = value.args[1].ty
    return (attrs.data_layout == layout and attrs.out_layout == layout
            and attrs.kernel_layout == "OI" + layout[2:]
            and isinstance(weight_ty, relax.TensorType) and weight_ty.shape is not None
            and all(isinstance(d, tvm.tirx.IntImm) for d in weight_ty.shape.values)
            and weight_ty.dtype == "float32")


def _is_channel_vector(bias: relax.Expr, conv_out: relax.Expr) -> bool:
    """A bias that adds one value per output channel: shape (1, C, 1...) or (C, 1...)."""
    bias_ty, out_ty = bias.ty, conv_out.ty
    if not isinstance(bias_ty, relax.TensorType) or bias_ty.shape is None or out_ty.shape is None:
        return False
    dims = [int(d) if isinstance(d, tvm.tirx.IntImm) else None for d in bias_ty.shape.values]
    channels = out_ty.shape.values[1]
    if not isinstance(channels, tvm.tirx.IntImm) or None in dims:
        return False
    trailing = len(out_ty.shape.values) - 2
    return dims in ([1, int(channels)] + [1] * trailing, [int(channels)] + [1] * trailing)


def _use_counts(func: relax.Function) -> dict[relax.Var, int]:
    counts: dict[relax.Var, int] = {}

    def count(expr):
        if isinstance(expr, relax.Var):
            counts[expr] = counts.get(expr, 0) + 1

    relax.analysis.post_order_visit(func.body, count)
    return counts
