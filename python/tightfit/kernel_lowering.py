"""How tightfit lowers its kernels to machine code: TVM's default TIR pipeline, after which a
kernel assumes of a tensor argument's address only the alignment of its element type.

TVM's packed-function wrapper tells LLVM that every tensor argument is 64-byte aligned (an
alignment assumption from the buffer's declaration), and TVM views an array only if it is
(`tvm.runtime.from_dlpack`). numpy's allocator aligns small arrays to 16 bytes, so about three
inputs in four were copied into an aligned buffer before each run, and a kernel fed a
misaligned one anyway crashed (LLVM had emitted aligned vector loads, `vmovaps`). With element
alignment assumed, LLVM emits unaligned vector loads (`vmovups`: AVX-512 and NEON load aligned
data through them at the same speed) and Session.run views any contiguous array.

Measured in one process, 2 threads, median of 21 rounds:
- kernels: the VM call on aligned inputs, 64-byte vs element alignment assumed, within 1%
  either way on eight zoo models (resnet18, transformer_encoder_wide, detector_fpn, ...; two
  shapes first 2-3% slower measured 0.1-0.3% on a rerun), and on mobilenet_v2 3.97 vs 4.06 ms
  at 1x3x224x224 but 3.47 vs 3.39 ms at 2x3x160x128;
- Session.run on the bench's feeds, copying misaligned inputs vs viewing them:
  gated_skip_block 3x8x16x16 6.06 -> 4.75 us, nonzero_gather 4x12 3.35 -> 3.07 us,
  nonzero_rows_tied 7x4 8.00 -> 6.49 us, mobilenet_v2_style 2x3x96x80 319 -> 314 us; inputs
  that happened to be aligned run as before.

The wrapper states the assumption as a `storage_alignment` attribute on each tensor
argument's data (TVM 0.27's binder, the only writer of that attribute); this pass, run after
TVM's lowering and before code generation, lowers it to the element's size. Tensors a kernel
allocates keep their own alignment.

A second pass after TVM's lowering keeps each kernel's accumulator tiles stack arrays
(`keep_tiles_on_the_stack`; schedules/isa.py says why they are not "global" buffers).
"""

from __future__ import annotations

import functools
import operator

import tvm
from tvm import tirx
from tvm.tirx import compilation_pipeline

from .schedules.isa import MAX_STACK_ALLOCA_BYTES, TILE_SCOPE

KERNEL_LOWERING = "tightfit"  # the TIR pipeline's name for tvm.tirx.build
STORAGE_ALIGNMENT = "storage_alignment"
# An allocation's annotation that LowerTVMBuiltin leaves it as it is (TVM's
# tirx::transform::kDisableLowerTVMBuiltin).
DISABLE_LOWER_BUILTIN = "disable_lower_builtin"


@tirx.transform.prim_func_pass(opt_level=0, name="tightfit.AssumeElementAlignedArguments")
def assume_element_aligned_arguments(func: tirx.PrimFunc, mod: tvm.IRModule, ctx) -> tirx.PrimFunc:
    return func.with_body(_with_element_alignment(func.body))


def _with_element_alignment(stmt: tirx.Stmt) -> tirx.Stmt:
    """`stmt` with each storage_alignment attribute lowered to its tensor's element size. The
    binder nests them, one per tensor argument, among the wrapper's argument checks: sequences
    and attribute statements, the kernel itself inside."""
    if isinstance(stmt, tirx.SeqStmt):
        return tirx.SeqStmt([_with_element_alignment(item) for item in stmt.seq])
    if not isinstance(stmt, tirx.AttrStmt):
        return stmt
    value = stmt.value
    if stmt.attr_key == STORAGE_ALIGNMENT:
        value = tirx.IntImm("int32", element_bytes(stmt.node))
    return tirx.AttrStmt(stmt.node, stmt.attr_key, value, _with_element_alignment(stmt.body))


def element_bytes(data: tirx.Var) -> int:
    """The size of one element of the tensor whose data `data` is (at least a byte: bool)."""
    return max(1, tvm.runtime.DataType(str(data.dtype)).bits // 8)


@tirx.transform.prim_func_pass(opt_level=0, name="tightfit.KeepTilesOnTheStack")
def keep_tiles_on_the_stack(func: tirx.PrimFunc, mod: tvm.IRModule, ctx) -> tirx.PrimFunc:
    """Each accumulator tile (a TILE_SCOPE buffer: schedules/isa.py) of constant size under
    MAX_STACK_ALLOCA_BYTES marked for LowerTVMBuiltin to leave as it is, a stack array; it
    would make a heap workspace of any buffer not in the "global" scope. Runs after TVM's
    lowering, whose StorageRewrite then has merged no tile with another buffer."""
    return func.with_body(_tiles_on_the_stack(func.body))


def _tiles_on_the_stack(stmt: tirx.Stmt) -> tirx.Stmt:
    if isinstance(stmt, tirx.AllocBuffer):
        if not _is_stack_tile(stmt.buffer):
            return stmt
        keep = tirx.const(True, "bool")  # LowerTVMBuiltin reads the annotation as a Bool
        return tirx.AllocBuffer(stmt.buffer, annotations={**stmt.annotations,
                                                          DISABLE_LOWER_BUILTIN: keep})
    if isinstance(stmt, tirx.SeqStmt):
        return tirx.SeqStmt([_tiles_on_the_stack(item) for item in stmt.seq])
    if isinstance(stmt, tirx.For):
        return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind,
                        _tiles_on_the_stack(stmt.body), stmt.thread_binding, stmt.annotations)
    if isinstance(stmt, tirx.IfThenElse):
        else_case = None if stmt.else_case is None else _tiles_on_the_stack(stmt.else_case)
        return tirx.IfThenElse(stmt.condition, _tiles_on_the_stack(stmt.then_case), else_case)
    if isinstance(stmt, tirx.AttrStmt):
        return tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, _tiles_on_the_stack(stmt.body))
    if isinstance(stmt, tirx.While):
        return tirx.While(stmt.condition, _tiles_on_the_stack(stmt.body))
    return stmt


def _is_stack_tile(buffer: tirx.Buffer) -> bool:
    if buffer.scope() != TILE_SCOPE or not all(isinstance(d, tirx.IntImm) for d in buffer.shape):
        return False
    elements = functools.reduce(operator.mul, (int(d) for d in buffer.shape), 1)
    return elements * tvm.runtime.DataType(str(buffer.dtype)).bits // 8 < MAX_STACK_ALLOCA_BYTES


def _kernel_lowering():
    lower, finalize_host, finalize_device = compilation_pipeline.get_tir_pipeline("default")
    lowering = tvm.transform.Sequential([lower, assume_element_aligned_arguments,
                                         keep_tiles_on_the_stack])
    return lowering, finalize_host, finalize_device


compilation_pipeline.register_tir_pipeline(KERNEL_LOWERING, _kernel_lowering)
