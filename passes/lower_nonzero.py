"""Compute NonZero with two compiled kernels: count, then fill.

SoD2 §3: NonZero is execution-determined (EDO): its output's size is known only after it runs,
so it needs a step that finds the size before the output can be allocated. TVM legalizes
`R.nonzero` to `relax.run.nonzero`, a Python function (numpy's nonzero) called back from the
VM: ~25 us per call for a 4x12 input, and absent from a phone's C++ runtime, so a package with a
NonZero would not run there. Here it becomes
  count     = sum(x != 0)                          (a reduction kernel)
  k         = the count as a shape (`tensor_to_shape`, the VM's builtin; a new symbolic dim)
  positions = the flat index of each nonzero [k]   (one serial scan kernel)
  indices   = positions unravelled over x's shape  [rank, k]   (int64, ONNX's layout)
Limits: inputs whose rank is known (every ONNX input is); a scalar is treated as a vector of
one, as ONNX and numpy do.
"""

from __future__ import annotations

import functools

import tvm
from tvm import relax, te, tirx
from tvm.script import tirx as T


@relax.expr_functor.mutator
class _NonZeroLowerer(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.scan_kernel: relax.GlobalVar | None = None

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.nonzero"):
            return call
        data = call.args[0]
        if not isinstance(data.ty, relax.TensorType) or data.ty.shape is None:
            return call  # rank unknown: TVM's own version
        dims = list(data.ty.shape.values) or [tirx.IntImm("int64", 1)]
        emit = self.builder_.emit
        flat = emit(relax.op.reshape(data, [product(dims)]))
        # (TVM's LLVM codegen compares bools as floats, which LLVM rejects: a bool is its own mask)
        nonzero = flat if data.ty.dtype == "bool" else emit(relax.op.not_equal(flat, relax.const(0, data.ty.dtype)))
        counted = emit(relax.op.sum(relax.op.astype(nonzero, "int64"), axis=[0], keepdims=True))
        count = tirx.Var("nonzero_count", "int64")
        self.builder_.match_cast(emit(relax.op.tensor_to_shape(counted)), relax.ShapeType([count]))
        if self.scan_kernel is None:
            self.scan_kernel = self.builder_.add_func(nonzero_positions(), "nonzero_positions")
        positions = emit(relax.op.call_tir(self.scan_kernel, [nonzero], relax.TensorType([count], "int64")))
        return self.builder_.call_te(_unravel, positions, dims, primfunc_name_hint="nonzero_unravel")


@tvm.transform.module_pass(opt_level=0, name="tightfit.LowerNonZero")
class LowerNonZero:
    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        lowerer = _NonZeroLowerer(mod)
        for global_var, func in list(mod.functions.items()):
            if isinstance(func, relax.Function):
                lowerer.builder_.update_func(global_var, lowerer.visit_expr(func))
        return lowerer.builder_.get()


@functools.cache
def nonzero_positions() -> tirx.PrimFunc:
    """The scan kernel, parsed on first use: TVMScript's parser inspects the whole call stack,
    which at import time took 0.44 s of every process that imports tightfit."""

    @T.prim_func(private=True, s_tir=True)
    def nonzero_positions(var_mask: T.handle, var_positions: T.handle):
        """The positions, in order, of the true elements of a vector (one serial pass)."""
        # a sequential scan: nothing to schedule, and the count written is the count allocated
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        size = T.int64()
        count = T.int64()
        mask = T.match_buffer(var_mask, (size,), "bool")
        positions = T.match_buffer(var_positions, (count,), "int64")
        with T.sblock("root"):
            found = T.sblock_alloc_buffer((1,), "int64")
            with T.sblock("scan"):
                T.reads(mask[0:size])
                T.writes(positions[0:count], found[0:1])
                found[0] = T.int64(0)
                for i in range(size):
                    if mask[i]:
                        positions[found[0]] = i
                        found[0] = found[0] + T.int64(1)

    return nonzero_positions


def _unravel(positions: te.Tensor, dims: list) -> te.Tensor:
    """[rank, k]: row d holds the coordinate along dim d of each flat position (row-major)."""
    strides = [tirx.IntImm("int64", 1)]
    for dim in reversed(dims[1:]):
        strides.insert(0, strides[0] * dim)

    def coordinate(axis, j):
        value = positions[j] // strides[-1] % dims[-1]
        for d in range(len(dims) - 2, -1, -1):
            value = tirx.Select(axis == d, positions[j] // strides[d] % dims[d], value)
        return value

    return te.compute((len(dims), positions.shape[0]), coordinate, name="nonzero_indices")


def product(dims: list) -> tirx.PrimExpr:
    """The product of `dims`, simplified (1 for none)."""
    size = tirx.IntImm("int64", 1)
    for dim in dims:
        size = size * dim
    return tvm.sym.Analyzer().simplify(size)
