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
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.tirx import compilation_pipeline

KERNEL_LOWERING = "tightfit"  # the TIR pipeline's name for tvm.tirx.build
STORAGE_ALIGNMENT = "storage_alignment"


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


def _kernel_lowering():
    lower, finalize_host, finalize_device = compilation_pipeline.get_tir_pipeline("default")
    lowering = tvm.transform.Sequential([lower, assume_element_aligned_arguments])
    return lowering, finalize_host, finalize_device


compilation_pipeline.register_tir_pipeline(KERNEL_LOWERING, _kernel_lowering)
