"""Build one-op Relax modules with symbolic dims, compile them through tightfit's kernel passes
and compare with a float64 reference: the shared harness of the kernel tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import tvm
from tvm import relax, tirx

import tightfit
from tightfit.passes import SelectConvAlgorithm, SelectGemmKernel
from tightfit.pipeline import PipelineOptions, build_config
from tightfit.schedules import FallbackCPUSchedule, ScheduleKernels
from tightfit.target import resolve_target

HOST = tvm.target.Target({"kind": "llvm", "num-cores": 2,
                          "mcpu": tvm.target.codegen.llvm_get_system_cpu()})
# where a test's numbers are one vector unit's (AVX-512's tiles, the direct depthwise kernels
# that only its builds hold), it schedules for that unit whatever the host has
AVX512_TARGET = {"kind": "llvm", "mcpu": "skylake-avx512"}


def dims(*names_or_sizes) -> list:
    """Shape dims: an int stays static, a name becomes a symbolic int64 var (same name, same var)."""
    made: dict[str, tirx.Var] = {}
    return [made.setdefault(d, tirx.Var(d, "int64")) if isinstance(d, str) else d
            for d in names_or_sizes]


def one_op_module(inputs: list[tuple[str, list]], weights: list[tuple[str, tuple]], build_op) -> tvm.IRModule:
    """main(inputs..., weights...) = build_op(*vars); weights are params after num_input."""
    params = [relax.Var(name, relax.TensorType(shape, "float32")) for name, shape in inputs]
    params += [relax.Var(name, relax.TensorType(list(shape), "float32")) for name, shape in weights]
    builder = relax.BlockBuilder()
    with builder.function("main", params, attrs={"num_input": len(inputs)}):
        with builder.dataflow():
            out = builder.emit_output(build_op(builder, *params))
        builder.emit_func_output(out)
    return builder.get()


def compile_with_kernels(mod: tvm.IRModule, target: tvm.target.Target = HOST,
                         knob_database: str | None = None):
    passes = [SelectConvAlgorithm(knob_database), SelectGemmKernel(knob_database),
              relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
              relax.transform.FoldConstant(), relax.transform.FuseOps(), relax.transform.FuseTIR(),
              ScheduleKernels(knob_database), FallbackCPUSchedule(knob_database)]
    with target, tvm.transform.PassContext(opt_level=3, config=build_config(PipelineOptions())):
        for compiler_pass in passes:
            mod = compiler_pass(mod)
        return mod, tvm.compile(mod, target)


def run(executable, *arrays: np.ndarray) -> np.ndarray:
    vm = relax.VirtualMachine(executable, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in arrays]).numpy()


def assert_close(actual: np.ndarray, expected: np.ndarray, context: str) -> None:
    assert actual.shape == expected.shape, f"{context}: shape {actual.shape} != {expected.shape}"
    scale = max(1.0, float(np.abs(expected).max()) if expected.size else 1.0)
    error = float(np.abs(actual - expected).max()) if expected.size else 0.0
    assert error <= 1e-4 * scale, f"{context}: max abs error {error} (scale {scale})"


def input_shapes(model: onnx.ModelProto, sizes: dict[str, int]) -> dict[str, list[int]]:
    """Each graph input's shape, its named dims taken from `sizes`."""
    return {value_info.name: [sizes.get(dim.dim_param, dim.dim_value)
                              for dim in value_info.type.tensor_type.shape.dim]
            for value_info in model.graph.input}


SCHEDULED = "tightfit.FallbackCPUSchedule"  # the pass after which every kernel is scheduled


def compile_keeping(model, *stages: str, **compile_args) -> tuple:
    """`tightfit.compile(model, **compile_args)`, then its module after each pass named in
    `stages` (after its first run, for a pass the pipeline runs more than once): one pipeline
    run for both a test's checks of the IR and of the outputs."""
    kept: dict[str, tvm.IRModule] = {}
    package = tightfit.compile(model, after_pass=kept.setdefault, **compile_args)
    return (package, *(kept[stage] for stage in stages))


def kernel_blocks(mod: tvm.IRModule) -> list[str]:
    """The tightfit kernel kinds present in the fused, scheduled module."""
    kinds = []
    for func in mod.functions.values():
        if isinstance(func, tirx.PrimFunc) and "tightfit.kernel" in func.script():
            text = func.script()
            kinds += [k for k in ("conv2d_direct", "conv2d_width_vectors", "conv2d_depthwise", "dense_packed",
                                  "matmul_packed_rhs", "winograd") if f'"{k}' in text]
    return kinds


def selected_algorithms(mod: tvm.IRModule) -> list[str]:
    """The algorithms SelectConvAlgorithm and SelectGemmKernel recorded on the module's
    kernels (`tightfit.algorithm`), sorted; read it before FuseTIR merges the kernels away."""
    return sorted(str(func.attrs["tightfit.algorithm"]) for func in mod.functions.values()
                  if func.attrs is not None and "tightfit.algorithm" in func.attrs)


# a parallel threshold per side of the work `if`: every run parallel, every run serial
THRESHOLDS = {"parallel": 1, "serial": 1 << 60}


def threshold_database(path: Path, threshold: int) -> str:
    """A knob database at `path` holding only a parallel threshold: 1 sends every kernel's run
    to its parallel version, 1 << 60 to its serial one."""
    path.write_text(json.dumps({"format": 1, "targets": {str(resolve_target("host").tvm_target): {
        "tiles": {}, "rates": {}, "min_parallel_work": threshold}}}))
    return str(path)


def sessions_on_each_side(models: list, directory: Path) -> list[dict]:
    """For each model, {"model": it, side: a session compiled with a knob database whose
    parallel threshold sends every run to that side of the work `if`} (conftest.THRESHOLDS)."""
    databases = {side: threshold_database(directory / f"{side}.json", threshold)
                 for side, threshold in THRESHOLDS.items()}
    return [{"model": model, **{
        side: tightfit.compile(model, options=PipelineOptions(knob_database=database)).session()
        for side, database in databases.items()}} for model in models]
