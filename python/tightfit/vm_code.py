"""The Relax VM code of a lowered module: native for running, bytecode for profiling.

TVM's Relax VM runs a function either as bytecode, each instruction decoded and dispatched by
its interpreter, or as native code (`exec_mode="compiled"`: VMTIRCodeGen writes the function as
a TIR function that calls the builtins and the kernels directly). The interpreter's dispatch,
register moves and packed-call wrapping cost about 0.1 us per instruction, and a small model
runs 90-170 of them (allocations, shape builtins, releases) around 15-30 kernels:
in one process, two threads, nonzero_gather at 4x12 ran 12.4 us as bytecode and 6.9 us native,
if_different_shapes 5.2 -> 3.0 us, transformer_encoder at 1x5 tokens 35.9 -> 27.7 us,
resnet_style at 1x3x32x32 195 -> 191 us.

Native code calls each kernel straight from the TIR function, where a VM instrument never sees
it, so the profiler (profiling.py) needs the interpreter. The executable therefore holds every
Relax function twice: native under its own name, bytecode under `interpreted(name)`, both
calling the same kernels; the bytecode costs the package a few kilobytes. Where the pipeline
has lowered a function's kernel sequences (passes/launch_kernel_sequences.py), the bytecode is
the function as it was before, which calls each kernel from the VM; else it is a copy.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax import vm_build

from .kernel_lowering import KERNEL_LOWERING

INTERPRETED_SUFFIX = "__interpreted"


def interpreted(function_name: str) -> str:
    """The name of the bytecode copy of the Relax function `function_name`."""
    return function_name + INTERPRETED_SUFFIX


def build_executable(mod: tvm.IRModule, target: tvm.target.Target) -> relax.VMExecutable:
    """`relax.build(mod, target, relax_pipeline=None)` with every Relax function compiled to
    native code, plus its bytecode copy under `interpreted(name)`, and the kernels lowered by
    KERNEL_LOWERING. Build inside the caller's PassContext (it carries the TIR lowering
    config)."""
    builder = relax.ExecBuilder()
    # VMCodeGen drops the Relax functions it emits and leaves the kernels to the native build
    vm_build._vmcodegen(builder, _bytecode_functions(mod), "bytecode")
    native = vm_build._vmcodegen(builder, _without_bytecode_functions(mod), "compiled")
    attrs = dict(mod.attrs) if mod.attrs else {}
    return vm_build._vmlink(builder=builder, target=target, tir_mod=vm_build._filter_tir(native),
                            tir_pipeline=KERNEL_LOWERING,
                            ext_libs=attrs.get("external_mods", []),
                            params=dict(attrs.get("const_name_to_constant", {})))


def _symbol(func: relax.Function) -> str:
    return str(func.attrs["global_symbol"])


def _bytecode_functions(mod: tvm.IRModule) -> tvm.IRModule:
    """The kernels and each Relax function's bytecode copy: the pipeline's, else the function
    renamed."""
    copies = tvm.IRModule(attrs=mod.attrs)
    symbols = {_symbol(func) for func in mod.functions.values() if isinstance(func, relax.Function)}
    for global_var, func in mod.functions.items():
        if not isinstance(func, relax.Function) or _symbol(func).endswith(INTERPRETED_SUFFIX):
            copies[global_var] = func
        elif interpreted(_symbol(func)) not in symbols:
            copies[global_var] = func.with_attr("global_symbol", interpreted(_symbol(func)))
    return copies


def _without_bytecode_functions(mod: tvm.IRModule) -> tvm.IRModule:
    return tvm.IRModule({gv: f for gv, f in mod.functions.items()
                         if not (isinstance(f, relax.Function) and _symbol(f).endswith(INTERPRETED_SUFFIX))},
                        attrs=mod.attrs)
