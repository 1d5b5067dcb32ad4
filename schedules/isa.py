"""What a kernel schedule needs to know about the target's vector unit.

DESIGN.md step 12: each schedule is written once for a family of targets, with the fp32 vector
width and the number of vector registers as parameters:
- x86 with AVX-512 (the host here): 16 lanes, 32 registers;
- x86 with AVX2: 8 lanes, 16 registers;
- Arm64 with NEON (phones, boards): 4 lanes, 32 registers.
The register budget bounds a GEMM micro-kernel's accumulator tile: rows x vectors accumulators,
plus one register per vector of B and one for the broadcast element of A. A second bound comes
from TVM 0.27's LowerTVMBuiltin: an intermediate buffer becomes a stack array (which LLVM then
keeps in registers) only when it is in the "global" scope, of constant size, and smaller than
kMaxStackAlloca = 1024 bytes; any other one is a heap workspace (TVMBackendAllocWorkspace), and
LLVM, unable to prove it does not alias the operands, stores every accumulator back after every
multiply-add (one vmovups per vfmadd231ps in the assembly). Measured on resnet_style, batch 1,
one thread: 16 x 16-lane tiles (1024 bytes, heap) 0.26 ms, 15 x 16 (960 bytes, stack) 0.16 ms.
The schedules size the tile buffer here, and put it in TILE_SCOPE rather than "global".
"global" kept it a stack array only until TVM's StorageRewrite merged it with another buffer of
constant size that it does not live beside: a kernel's serial versions sit in branches of one
function body, so one version's tile could share an allocation with another's packed input,
which at 1 KB or more is a heap workspace (a conv1d over a symbolic length, 40 -> 32 channels,
stride 2, 2 x 77, AVX-512, one thread: 23.7 us against 7.3 us over a static length).
StorageRewrite merges no "local" buffer, and tightfit's lowering (kernel_lowering.py) tells
LowerTVMBuiltin to leave a TILE_SCOPE buffer of constant size under MAX_STACK_ALLOCA_BYTES a
stack array, as "global" ones are.
Limits: fp32 only; SVE/SME and Arm dotprod/i8mm (int8) are not used.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm


FP32_BYTES = 4
# TVM's runtime::kMaxStackAlloca: larger constant-size local buffers go to the heap.
MAX_STACK_ALLOCA_BYTES = 1024
# The storage scope of a kernel's accumulator tiles (see above).
TILE_SCOPE = "local"


@dataclass(frozen=True)
class VectorISA:
    name: str
    lanes: int  # fp32 elements in one vector register
    registers: int  # architectural vector registers
    # whether a multiply-add takes its broadcast scalar from memory (AVX-512's embedded
    # broadcast, NEON's by-element multiply-add) rather than from a vbroadcastss of its own
    fma_reads_broadcast: bool
    # whether masked vector loads and stores cost what plain ones do (AVX-512's mask
    # registers); NEON has none (LLVM loads and stores lane by lane) and AVX2's vmaskmovps is
    # slow on AMD Zen (row_chunks.py)
    fast_masks: bool = False

    def fits_registers(self, rows: int, vectors: int) -> bool:
        """Does a rows x vectors accumulator tile fit in registers, with its B vectors and one A
        broadcast, and stay a stack array (see above)?"""
        tile_bytes = rows * vectors * self.lanes * FP32_BYTES
        return rows * vectors + vectors + 1 <= self.registers and tile_bytes < MAX_STACK_ALLOCA_BYTES


AVX512 = VectorISA("avx512", lanes=16, registers=32, fma_reads_broadcast=True, fast_masks=True)
AVX2 = VectorISA("avx2", lanes=8, registers=16, fma_reads_broadcast=False)
NEON = VectorISA("neon", lanes=4, registers=32, fma_reads_broadcast=True)
SSE = VectorISA("sse", lanes=4, registers=16, fma_reads_broadcast=False)


def isa_for_target(target: tvm.target.Target | None) -> VectorISA:
    """The vector unit of an LLVM CPU target (the current target context when None)."""
    target = target or tvm.target.Target.current(allow_none=True)
    if target is None or target.kind.name != "llvm":
        return SSE
    attrs = dict(target.attrs)
    if attrs.get("feature.is_aarch64", False) or "aarch64" in str(attrs.get("mtriple", "")):
        return NEON
    if _has_feature("avx512f", target):
        return AVX512
    if _has_feature("avx2", target):
        return AVX2
    return SSE


def _has_feature(feature: str, target: tvm.target.Target) -> bool:
    try:
        return bool(tvm.target.codegen.target_has_features(feature, target))
    except Exception:  # TVM raises for targets whose CPU LLVM does not know
        return False
