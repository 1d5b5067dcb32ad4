"""Replace each fp32 matmul with a tightfit register-tile GEMM kernel.

DESIGN.md steps 6 and 8 (GEMM layouts and packing). Two kernels (schedules/gemm.py):
- `dense_packed`, when the right operand is computed from weights alone (ONNX Gemm and
  MatMul with an initializer, usually behind the importer's transpose): the operand is packed
  into column panels of NB = vectors x lanes by a weight-only binding, which
  PreTransformWeights (after this pass) computes once at compile time;
- `matmul_packed_rhs`, when both operands are computed at run time (attention): the kernel packs
  the right operand itself.
The register tile (rows, vectors) comes from the knob database when a search has measured this
shape bucket on the target, else from the register budget (register_tile.default_tile_knobs).
The row extent (the left operand's second-last axis) may be symbolic: the kernel is then
scheduled in two versions dispatched at run time (schedules/dispatch.py).
A permute_dims that is the only use of a `matmul_packed_rhs` product and keeps its columns last
is done by the kernel's write-back, which stores each row of the tile where the permuted
result holds it: attention's head merge ([b, h, s, d] -> [b, s, h, d] before the output
projection) was a transpose kernel of its own, which read and wrote every value once more.
VM time, medians of 11 alternating turns (Zen 4, 2 threads), without -> with:
transformer_encoder_dynamo 5.67 -> 5.53 us at 1x5, 30.27 -> 29.52 us at 3x16;
transformer_encoder 37.4 -> 36.6 us at 3x16, 57.3 -> 54.7 us at 2x33; torch_transformer_layers
25.4 -> 24.4 us at 3x12x32; speech_encoder(_dynamo) and transformer_encoder_wide 0.6-1.7%.
Likewise a right operand that is permute_dims swapping its source's last two axes (attention's
K^T) is packed by the kernel from the source (`rhs_transposed`), not transposed by a kernel
first: transformer_encoder_dynamo 34.9 -> 33.8 us at 3x16, transformer_encoder 35.8 -> 34.5
us at 3x16, speech_encoder 28.4 -> 26.8 us at 2x77x40; within 2% at 1x5 (a noisy host, two
runs of 11 turns agreeing).
Limits: both operands at least 2-D; batch axes of two run-time operands must match exactly (a
broadcasting batch matmul keeps TVM's legalization); fp32 only.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx

from ..schedules import gemm
from ..schedules.isa import isa_for_target
from ..schedules.kernel_call import WeightOnly, emit_kernel, emit_weight_transform
from ..schedules.knob_database import KnobDatabase
from ..schedules.register_tile import SYMBOLIC_COLUMNS, default_tile_knobs
from .permute_patterns import last_two_axes_swapped, permutes_of_single_use


@relax.expr_functor.mutator
class _MatmulRewriter(relax.PyExprMutator):
    def __init__(self, mod, func, isa, database):
        super().__init__(mod)
        self.weight_only = WeightOnly(func)
        self.isa = isa
        self.database = database
        self.permutes = permutes_of_single_use(func)
        self.transposed_rhs = last_two_axes_swapped(func)
        # a permute_dims that a matmul kernel's write-back does -> that kernel's result
        self.done_by_write_back: dict[relax.Var, relax.Var] = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        if binding.var in self.done_by_write_back:
            self.set_var_remap(binding.var, self.done_by_write_back[binding.var])
            return
        if not _is_fp32_matmul(value):
            super().visit_var_binding_(binding)
            return
        lhs_ty, rhs_ty = value.args[0].ty, value.args[1].ty
        rows = lhs_ty.shape.values[-2]
        columns = rhs_ty.shape.values[-1]
        if self.weight_only(value.args[1]) and _is_static_2d(rhs_ty):
            kind = gemm.DENSE
        elif _same_batch(lhs_ty, rhs_ty):
            kind = gemm.MATMUL
        else:
            super().visit_var_binding_(binding)
            return
        static_columns = int(columns) if isinstance(columns, tirx.IntImm) else SYMBOLIC_COLUMNS
        knobs = (self.database.tile_knobs(kind, static_columns, rows, self.isa)
                 or default_tile_knobs(self.isa, static_columns, rows))
        transposed = self.transposed_rhs.get(value.args[1]) if kind == gemm.MATMUL else None
        lhs = self.visit_expr(value.args[0])
        rhs = self.visit_expr(value.args[1] if transposed is None else transposed)
        record = {"tightfit.algorithm": kind}
        if kind == gemm.DENSE:
            packed = emit_weight_transform(self.builder_, gemm.pack_dense_weight, [rhs],
                                           "dense_weight_panels",
                                           self.weight_only.transformed_name(value.args[1], "panels"),
                                           panel_width=knobs.vectors * self.isa.lanes)
            new_var = emit_kernel(self.builder_, gemm.dense_packed, [lhs, packed], "dense_packed",
                                  record, binding.var.name, out_features=int(columns),
                                  rows=knobs.rows, vectors=knobs.vectors,
                                  reduction_unroll=knobs.reduction_unroll)
        else:
            permute = self.permutes.get(binding.var)
            new_var = emit_kernel(self.builder_, gemm.matmul_packed_rhs, [lhs, rhs],
                                  "matmul_packed_rhs", record,
                                  (permute.var if permute else binding.var).name,
                                  rows=knobs.rows, vectors=knobs.vectors, lanes=self.isa.lanes,
                                  reduction_unroll=knobs.reduction_unroll,
                                  out_axes=permute.axes if permute else None,
                                  rhs_transposed=transposed is not None)
            if permute:
                self.done_by_write_back[permute.var] = new_var
                return
        self.set_var_remap(binding.var, new_var)


@tvm.transform.module_pass(opt_level=0, name="tightfit.SelectGemmKernel")
class SelectGemmKernel:
    def __init__(self, database_path: str | None = None):
        self.database_path = database_path

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        target = tvm.target.Target.current(allow_none=True)
        isa = isa_for_target(target)
        database = KnobDatabase.open(self.database_path, target)
        for global_var, func in list(mod.functions.items()):
            if not isinstance(func, relax.Function) or not _has_matmul(func):
                continue
            rewriter = _MatmulRewriter(mod, func, isa, database)
            new_func = rewriter.visit_expr(func)
            mod = rewriter.builder_.get()
            mod[global_var] = relax.analysis.remove_all_unused(new_func)
        return mod


def _is_fp32_matmul(value) -> bool:
    if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
        return False
    if value.op.name != "relax.matmul":
        return False
    lhs_ty, rhs_ty = value.args[0].ty, value.args[1].ty
    if not all(isinstance(ty, relax.TensorType) and ty.shape is not None for ty in (lhs_ty, rhs_ty)):
        return False
    if lhs_ty.dtype != "float32" or rhs_ty.dtype != "float32":
        return False
    if str(value.attrs.out_dtype or "float32") not in ("", "void", "float32"):
        return False
    return len(lhs_ty.shape.values) >= 2 and len(rhs_ty.shape.values) >= 2


def _is_static_2d(ty) -> bool:
    dims = ty.shape.values
    return len(dims) == 2 and all(isinstance(d, tirx.IntImm) for d in dims)


def _same_batch(lhs_ty, rhs_ty) -> bool:
    lhs_batch, rhs_batch = lhs_ty.shape.values[:-2], rhs_ty.shape.values[:-2]
    if len(lhs_batch) != len(rhs_batch):
        return False
    analyzer = tvm.sym.Analyzer()
    return all(analyzer.can_prove_equal(a, b) for a, b in zip(lhs_batch, rhs_batch))


def _has_matmul(func: relax.Function) -> bool:
    found = []
    relax.analysis.post_order_visit(
        func, lambda node: found.append(node) if _is_fp32_matmul(node) else None)
    return bool(found)
