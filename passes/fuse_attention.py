"""Replace each attention (softmax(Q K^T x scale) V) with tightfit's attention kernel.

SoD2 §4.2 (fusion over symbolic shapes: the scores' rows, their softmax and the weighted sum
all run over the same symbolic sequence length, which RDP resolves) and DESIGN.md step 6 (the
kernels of the hot ops). The chain matched, every intermediate used only by the next op:
  scores = matmul(Q, K^T)                [*batch, queries, depth] x [*batch, depth, keys]
  scores = multiply(scores, s) or divide(scores, s)   optional; s one number (one element)
  scores = add(scores, mask)             optional; mask float32, broadcast to the scores
  probabilities = softmax(scores, axis=-1)
  out = matmul(probabilities, V)         V [*batch, keys, values]
and, where it is out's only use and keeps the columns last, a permute_dims of out (attention's
head merge), which the kernel's stores do. Q, K^T and V are each read from the farthest tensor
they are a layout of (passes/strided_views.py): a K^T made by permute_dims(K) from K, the
heads that a reshape, a transpose and a slice, split or take cut from a QKV projection from
the projection, so none of those copies is made; three projections of one input that give Q,
K and V are merged into one GEMM first (passes/merged_projections.py: bert_encoder 5.30 ->
5.00 us at 1x5). The kernel (schedules/attention.py) never writes the scores out; it is
emitted as its TE definition, marked, and ScheduleKernels gives it its body.

Whole models, VM time, medians of 9 alternating turns (Zen 4, 2 threads), three kernels -> one:
torch_transformer_layers 24.5 -> 23.1 us at 3x12x32, speech_encoder 26.8 -> 23.8 us at 2x77x40,
8.6 -> 7.6 us at 1x40x40 (bench/ab_revisions.py).
Limits: fp32; the batch axes of Q, K and V equal (no broadcasting); static heads of at most
MAX_HEAD_WIDTH; any other op between the matmuls (a mask by `where`, a scale after the mask)
keeps the three kernels.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import tvm
from tvm import relax, tirx

from ..schedules.attention import ATTENTION_ATTR, DIVIDE, MULTIPLY, OperandLayout, attention
from ..schedules.kernel_call import WeightOnly, emit_kernel
from ..schedules.row_chunks import substitute
from .merged_projections import Projection, emit_merged, shared_projections, view_in_merged
from .permute_patterns import permutes_of_single_use
from .strided_views import StridedView, strided_view

# The widest head (Q's and V's last axes) fused. The kernel keeps the tile's Q^T rows and V's
# column sums in registers, and runs its multiply-adds with a broadcast operand each; over wider
# heads the register-tiled GEMM kernels win. Alone, fused against the three kernels (us, Zen 4,
# 2 threads, 4 heads): head 8 at 33 / 128 tokens 4.2 / 21.2 against 6.1 / 33.0; head 16 at 128
# tokens 52.7 against 38.8; head 32 at 128 tokens 101.8 against 60.4; head 64 at 16 / 128 tokens
# 7.4 / 182 against 4.3 / 100.
MAX_HEAD_WIDTH = 8

# FuseOps fuses nothing into an opaque kernel: an epilogue fused in would leave the marked
# PrimFunc's blocks different from the definition the kernel replaces
OPAQUE = 8


@dataclass(frozen=True)
class _Attention:
    operands: tuple[StridedView, ...]  # Q, K (not K^T), V, and a mask where there is one
    # where Q, K and V are three projections of one input (merged_projections.py)
    projections: list[Projection] | None
    scales: tuple[tuple[relax.Expr, str], ...]  # (one-element tensor, MULTIPLY or DIVIDE)


@relax.expr_functor.mutator
class _AttentionRewriter(relax.PyExprMutator):
    def __init__(self, mod, func):
        super().__init__(mod)
        self.weight_only = WeightOnly(func)
        self.attentions = _attentions(func, self.weight_only)
        self.permutes = permutes_of_single_use(func)
        # a permute_dims that the kernel's stores do -> the kernel's result
        self.done_by_stores: dict[relax.Var, relax.Var] = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.done_by_stores:
            self.set_var_remap(binding.var, self.done_by_stores[binding.var])
            return
        found = self.attentions.get(binding.var)
        if found is None:
            super().visit_var_binding_(binding)
            return
        permute = self.permutes.get(binding.var)
        operands = self._operands(found)
        scalars = _KernelScalars()
        layouts = tuple(OperandLayout(scalars.of(view.offset), tuple(map(scalars.of, view.shape)),
                                      tuple(map(scalars.of, view.strides)))
                        for view in operands)
        args = [*(self.visit_expr(view.source) for view in operands),
                *(self.visit_expr(scale) for scale, _ in found.scales)]
        scale_ops = [op for _, op in found.scales]
        options = {"layouts": [[layout.offset, list(layout.shape), list(layout.strides)]
                               for layout in layouts],
                   "scale": scale_ops, "out_axes": list(permute.axes) if permute else []}
        new_var = emit_kernel(self.builder_, attention, args, "attention",
                              {ATTENTION_ATTR: options, "op_pattern": OPAQUE},
                              (permute.var if permute else binding.var).name, plain_dims=True,
                              scalars=scalars.pairs, layouts=layouts, scale_ops=scale_ops,
                              out_axes=permute.axes if permute else None)
        if permute:
            self.done_by_stores[permute.var] = new_var
            return
        self.set_var_remap(binding.var, new_var)

    def _operands(self, found: _Attention) -> tuple[StridedView, ...]:
        """The attention's operand views; Q, K and V read from their projections merged into
        one where they are three projections of one input and each view moves to its columns."""
        if found.projections is None:
            return found.operands
        total = sum(projection.columns for projection in found.projections)
        starts = [sum(projection.columns for projection in found.projections[:index])
                  for index in range(len(found.projections))]
        moved = [view_in_merged(view, start, projection.columns, total)
                 for view, start, projection in zip(found.operands, starts, found.projections)]
        if any(view is None for view in moved):
            return found.operands
        merged = emit_merged(self.builder_, found.projections, self.visit_expr, self.weight_only)
        return (*[dataclasses.replace(view, source=merged) for view in moved],
                *found.operands[3:])


class _KernelScalars:
    """The kernel's scalar parameters: the symbolic dims the operands' layouts are expressions
    of, passed as the VM holds them (an expression of them passed would be computed by a
    kernel call of its own before each attention); constants stay constants, so that the
    kernel's loads of contiguous rows are vector loads."""

    def __init__(self):
        self.pairs: list[tuple[tirx.Var, tirx.Var]] = []  # (the function's dim, the parameter)

    def of(self, expr):
        return substitute(expr, {dim: self._parameter(dim)
                                 for dim in tirx.analysis.undefined_vars(expr)})

    def _parameter(self, dim: tirx.Var) -> tirx.Var:
        for known, parameter in self.pairs:
            if known.same_as(dim):
                return parameter
        self.pairs.append((dim, tirx.Var(dim.name, dim.ty.dtype)))
        return self.pairs[-1][1]


@tvm.transform.module_pass(opt_level=0, name="tightfit.FuseAttention")
class FuseAttention:
    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        for global_var, func in list(mod.functions.items()):
            if not isinstance(func, relax.Function) or not _attentions(func, WeightOnly(func)):
                continue
            rewriter = _AttentionRewriter(mod, func)
            new_func = rewriter.visit_expr(func)
            mod = rewriter.builder_.get()
            mod[global_var] = relax.analysis.remove_all_unused(new_func)
        return mod


def _attentions(func: relax.Function, weight_only: WeightOnly) -> dict[relax.Var, _Attention]:
    """The weighted sum's var of each attention chain (module docstring) -> its operands."""
    bindings = relax.analysis.get_var2val(func)
    users = {var: var_users for block in func.body.blocks
             if isinstance(block, relax.DataflowBlock)
             for var, var_users in relax.analysis.udchain(block).items()}

    def only_user(var):
        """The binding var of `var`'s only use, if it has one and is a dataflow var."""
        found = users.get(var, [])
        return found[0] if isinstance(var, relax.DataflowVar) and len(found) == 1 else None

    attentions = {}
    for probabilities, value in bindings.items():
        if not (_is_call(value, "relax.nn.softmax") and _is_fp32(value.args[0])
                and int(value.attrs.axis) % len(value.args[0].ty.shape.values)
                == len(value.args[0].ty.shape.values) - 1):
            continue
        logits = value.args[0]
        masked, mask = _unmasked(logits, bindings)
        scores, scale = _unscaled(masked, bindings)
        chain = [scores, *([masked] if scale is not None else []),
                 *([logits] if mask is not None else []), probabilities]
        if not all(_same(only_user(var), user) for var, user in zip(chain, chain[1:])):
            continue
        product = bindings.get(scores)
        out = only_user(probabilities)
        weighted = bindings.get(out) if out is not None else None
        if not (_is_call(product, "relax.matmul") and _is_call(weighted, "relax.matmul")
                and weighted.args[0].same_as(probabilities)):
            continue
        # a Q or a K^T scaled by one number scales the scores by it
        (queries, query_scale), (keys_transposed, key_scale) = (
            _unscaled(operand, bindings) for operand in product.args)
        operands = _operand_views(queries, keys_transposed, weighted.args[1], bindings)
        if operands is None or not _shapes_fit(*operands):
            continue
        if mask is not None:
            mask_view = _broadcast(strided_view(mask, bindings), logits.ty.shape.values)
            if mask_view is None:
                continue
            operands = (*operands, mask_view)
        scales = tuple(found for found in (query_scale, key_scale, scale) if found is not None)
        projections = shared_projections(list(operands[:3]), bindings, users, weight_only)
        attentions[out] = _Attention(operands, projections, scales)
    return attentions


def _unmasked(logits: relax.Expr, bindings) -> tuple[relax.Expr, relax.Expr | None]:
    """(the scores before an added float32 mask, the mask), or (`logits`, None) where nothing
    is added to them. The scores are the operand of the logits' shape bound to a matmul or a
    scaling of one; the mask may broadcast to them, not them to it (the kernel's batch is
    Q's)."""
    value = bindings.get(logits)
    if not _is_call(value, "relax.add"):
        return logits, None
    for scores, mask in (value.args, reversed(value.args)):
        if (_is_fp32(mask) and _is_fp32(scores) and _same_shape(scores, logits)
                and any(_is_call(bindings.get(scores), name) for name in
                        ("relax.matmul", "relax.multiply", "relax.divide"))):
            return scores, mask
    return logits, None


def _same_shape(tensor, other) -> bool:
    shape, other_shape = tensor.ty.shape.values, other.ty.shape.values
    analyzer = tvm.sym.Analyzer()
    return len(shape) == len(other_shape) and all(
        analyzer.can_prove_equal(dim, other_dim) for dim, other_dim in zip(shape, other_shape))


def _broadcast(view: StridedView, shape) -> StridedView | None:
    """`view` broadcast to `shape` (axes it lacks or has as 1 read at stride 0), else None."""
    missing = len(shape) - len(view.shape)
    if missing < 0:
        return None
    analyzer = tvm.sym.Analyzer()
    zero = tirx.const(0, "int64")
    strides = []
    for dim, stride, wanted in zip((*[None] * missing, *view.shape),
                                   (*[zero] * missing, *view.strides), shape):
        if dim is not None and analyzer.can_prove_equal(dim, wanted):
            strides.append(stride)
        elif dim is None or analyzer.can_prove_equal(dim, 1):
            strides.append(zero)
        else:
            return None
    return StridedView(view.source, view.offset, tuple(shape), tuple(strides))


def _operand_views(queries, keys_transposed, values, bindings):
    """Q, K and V as views of the tensors they are layouts of; None where one is not float32
    or of a known rank."""
    if not all(_is_fp32(operand) and len(operand.ty.shape.values) >= 2
               for operand in (queries, keys_transposed, values)):
        return None
    q, k_transposed, v = (strided_view(operand, bindings)
                          for operand in (queries, keys_transposed, values))
    rank = len(k_transposed.shape)
    return q, k_transposed.permuted([*range(rank - 2), rank - 1, rank - 2]), v


def _unscaled(tensor: relax.Expr, bindings) -> tuple[relax.Expr, tuple[relax.Expr, str] | None]:
    """(the tensor before a multiply or divide by one number (a float32 tensor of one element),
    (that tensor, the op)), or (`tensor`, None) where it is not scaled so."""
    value = bindings.get(tensor)
    if _is_call(value, "relax.multiply"):
        for scaled, scale in (value.args, reversed(value.args)):
            if _is_one_number(scale, scaled):
                return scaled, (scale, MULTIPLY)
    if _is_call(value, "relax.divide") and _is_one_number(value.args[1], value.args[0]):
        return value.args[0], (value.args[1], DIVIDE)
    return tensor, None


def _shapes_fit(q: StridedView, k: StridedView, v: StridedView) -> bool:
    """Q [*batch, queries, depth], K [*batch, keys, depth], V [*batch, keys, values] with equal
    batch axes and static depth and values of at most MAX_HEAD_WIDTH."""
    if not len(q.shape) == len(k.shape) == len(v.shape):
        return False
    analyzer = tvm.sym.Analyzer()
    equal = [(a, b) for a, b, c in zip(q.shape[:-2], k.shape[:-2], v.shape[:-2])
             for a, b in ((a, b), (a, c))]
    equal += [(q.shape[-1], k.shape[-1]), (k.shape[-2], v.shape[-2])]
    return (all(analyzer.can_prove_equal(a, b) for a, b in equal)
            and all(isinstance(dim, tirx.IntImm) and int(dim) <= MAX_HEAD_WIDTH
                    for dim in (q.shape[-1], v.shape[-1])))


def _same(var, other) -> bool:
    return var is not None and var.same_as(other)


def _is_call(value, op_name: str) -> bool:
    return (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
            and value.op.name == op_name)


def _is_fp32(expr) -> bool:
    ty = expr.ty
    return (isinstance(ty, relax.TensorType) and ty.dtype == "float32" and ty.shape is not None
            and isinstance(ty.shape, relax.ShapeExpr))


def _is_one_number(expr, scaled) -> bool:
    """A float32 tensor of one element whose broadcast leaves `scaled`'s shape as it is (0-d,
    or of ones and of no higher rank)."""
    if not (_is_fp32(expr) and _is_fp32(scaled)):
        return False
    dims = expr.ty.shape.values
    return (len(dims) <= len(scaled.ty.shape.values)
            and all(isinstance(dim, tirx.IntImm) and int(dim) == 1 for dim in dims))
