"""The compilation pipeline: one ordered list of passes, from imported Relax to VM-ready code.

DESIGN.md "The pipeline". Only passes that exist are listed; each later issue inserts its passes
at its step. `run_pipeline` applies them one at a time so that the IR after every pass can be
written out (`dump_ir`) and a failure names the pass it happened in.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from .errors import CompilationError
from .passes import (
    BroadcastAtRunTime,
    CheckDimsOnShapes,
    ClassifyDynamism,
    FoldBatchNorm,
    FoldConstantCalls,
    FoldConstantsOnHost,
    FuseAttention,
    FuseThroughUnitAxisViews,
    InlineBranchFunctions,
    KeepReshapesAsViews,
    LaunchKernelSequences,
    LowerNonZero,
    LowerScans,
    MoveIntoBranches,
    PreTransformWeights,
    RankDimensionPropagation,
    ReuseShapeValues,
    SelectConvAlgorithm,
    SelectGemmKernel,
    ShareIdenticalKernels,
    ShareSymbolicStorage,
    SinkIntoBranches,
    SplitBlocksWhereDimsAreBound,
    UseFastMath,
    WriteScalarsToShapeHeap,
    legalize_views,
)
from .schedules import FallbackCPUSchedule, ScheduleKernels, legalize_as_onnx, legalize_max_pool
from .weight_file import WeightTensor
from .target import CompileTarget


@dataclass(frozen=True)
class PipelineOptions:
    """Switches for optional passes; the defaults are what `tightfit compile` uses."""

    fallback_schedule: bool = True
    # tightfit's kernels for conv and matmul (issue 5); off leaves them to TVM's legalization
    fast_kernels: bool = True
    # exp/erf/tanh/softmax as vectorizable polynomials (a few ulp) instead of libm calls, and
    # float additions reassociated in code generation (CompileTarget.code_generation)
    fast_math: bool = True
    # the knob database measured by a knob search (None: $TIGHTFIT_KNOB_DATABASE, else defaults)
    knob_database: str | None = None
    # a MetaSchedule database (`tightfit tune --db DIR`): its best records schedule the kernels
    # they were tuned for, ahead of tightfit's own schedules
    tuning_database: str | None = None
    # the conv algorithms SelectConvAlgorithm may choose from (None: all; to compare kernels); a
    # conv that none of them applies to keeps its own candidates
    conv_algorithms: tuple[str, ...] | None = None
    # TVM's checks of every kernel's arguments as it is called (type, rank, shape, strides,
    # alignment), each with its error message; off, they are left out (build_config)
    kernel_argument_checks: bool = False


def passes(target: CompileTarget, options: PipelineOptions = PipelineOptions()) -> list[tvm.transform.Pass]:
    # the passes read the target from the context run_pipeline sets (one needs it when made)
    return [
        # 1. normalize the imported graph (models with `If` import without dataflow blocks), then
        #    understand it: dynamism classes and Rank and Dimension Propagation (SoD2 §3, §4.1)
        tvm.transform.Sequential([relax.transform.ConvertToDataflow()], name="ConvertToDataflow"),
        FoldBatchNorm(),
        relax.transform.DecomposeOpsForInference(),
        # constants folded with numpy where it computes what the kernel would; the rest by TVM,
        # which compiles each call (tens of ms apiece)
        FoldConstantsOnHost(),
        FoldConstantCalls(),
        ClassifyDynamism(),
        RankDimensionPropagation(),
        # what RDP bound to constants (values it knows) folds on: those calls run no kernel
        FoldConstantCalls(),
        # an elementwise op whose shape RDP could not resolve is broadcast at run time
        BroadcastAtRunTime(),
        # 2. kernels and weights: attention as one kernel (SoD2 §4.2), each conv's algorithm and
        #    each GEMM's packing chosen by cost (MNN pre-inference), then every weight transform
        #    computed once, offline (FlexNN)
        *([FuseAttention(),
           SelectConvAlgorithm(options.knob_database, algorithms=options.conv_algorithms),
           SelectGemmKernel(options.knob_database)]
          if options.fast_kernels else []),
        *([UseFastMath()] if options.fast_math else []),
        PreTransformWeights(),
        # 3. lower to TIR and fuse (NonZero and cumulative sums and products to compiled kernels,
        #    sorts and sampling to their library kernels first); view kernels and max pools are
        #    marked for step 4
        LowerNonZero(),
        LowerScans(),
        relax.backend.DispatchSampling(),
        relax.backend.DispatchSortScan(),
        relax.transform.LegalizeOps({**legalize_views(), **legalize_max_pool(), **legalize_as_onnx()}),
        relax.transform.AnnotateTIROpPattern(),
        FuseThroughUnitAxisViews(),
        FoldConstantCalls(),
        # what fusion can join to a branch's kernels goes into the branch (SoD2 §3, §4.2)
        MoveIntoBranches(),
        # a kernel that computes a dim is not fused with one that uses it
        SplitBlocksWhereDimsAreBound(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        # the branches MoveIntoBranches outlined for FuseOps go back into their `If`s
        InlineBranchFunctions(),
        # a reshape kernel that fusion left alone becomes a view (the VM's reshape), before it is
        # scheduled: those LegalizeOps marked, then any other whose PrimFunc TVM proves a reshape
        KeepReshapesAsViews(),
        relax.transform.RewriteDataflowReshape(),
        relax.transform.DeadCodeElimination(),
        # a kernel that repeated blocks made several times is scheduled and compiled once
        ShareIdenticalKernels(),
        # 4. schedule kernels: tuned records where the database has them, tightfit's kernels in one
        #    version per shape bucket, then the rest
        *([_apply_tuning_records(options.tuning_database, target)] if options.tuning_database else []),
        *([ScheduleKernels(options.knob_database)] if options.fast_kernels else []),
        *([FallbackCPUSchedule(options.knob_database)] if options.fallback_schedule else []),
        # 5. lower dataflow to VM code: each branch of an If computes what only it uses (SoD2
        #    §3); plan memory: TVM's plan shares storage between equal sizes, then storages of
        #    different symbolic sizes are shared (SoD2 §4.4.1)
        relax.transform.ToNonDataflow(),
        SinkIntoBranches(),
        relax.transform.RemovePurityChecking(),
        relax.transform.CallTIRRewrite(),
        relax.transform.StaticPlanBlockMemory(),
        ShareSymbolicStorage(),
        # 6. each sequence of kernels becomes one TIR function that calls them in turn, its
        #    intermediates at offsets in one arena (MNN pre-allocation); RDP's dim checks are
        #    made on shape values first, so that a checked tensor does not end a sequence
        CheckDimsOnShapes(),
        LaunchKernelSequences(),
        relax.transform.LowerAllocTensor(),
        relax.transform.KillAfterLastUse(),
        relax.transform.LowerRuntimeBuiltin(),
        relax.transform.ComputePrimValue(),
        relax.transform.VMShapeLower(),
        # an If's condition and a data-dependent dim go from their kernel straight into the
        # VM's shape heap, with no tensor allocated for one number
        WriteScalarsToShapeHeap(),
        ReuseShapeValues(),
        relax.transform.AttachGlobalSymbol(),
    ]


# TIR lowering options for code generation: a vectorized loop whose iterations are bounds
# checked becomes masked vector loads and stores instead of a scalar loop, where TVM 0.27 can:
# only when every access in the loop is a vector at the check's own base (a plain copy, not a
# kernel's write-back with an epilogue, which stays a bounds-checked loop for LLVM)
BUILD_CONFIG = {"tirx.enable_buffer_level_predication": True}


def build_config(options: PipelineOptions) -> dict:
    """The TIR lowering config of a build with `options`. Without kernel argument checks: a
    kernel is called only by the model's own code, with tensors shaped by the plan, after
    Session.run has checked the inputs against the model's (types, ranks, fixed dims, and each
    symbolic dim equal wherever it appears); the checks doubled the LLVM IR (an ONNX Attention
    node: 13,006 lines, 6,873 without) and loading the JIT-compiled code (mobilenet_v2: 6.2-6.9 s
    to create a session, 3.2-3.6 s without; its run time the same). With them, a wrong shape
    inside the model (a bug in tightfit) raises an error instead of reading past a tensor."""
    if options.kernel_argument_checks:
        return BUILD_CONFIG
    return {**BUILD_CONFIG, "tirx.disable_assert": True}


def _apply_tuning_records(database: str, target: CompileTarget) -> tvm.transform.Pass:
    if not (Path(database) / "database_tuning_record.json").is_file():
        raise CompilationError(f"{database} holds no tuning records: create it with `tightfit tune MODEL "
                               f"--db {database} ...` first")
    with target.tvm_target:
        return relax.transform.MetaScheduleApplyDatabase(str(database))


# The kernels are fused and not yet scheduled after this pass: what `tightfit tune` tunes, and
# what MetaScheduleApplyDatabase then finds in the database.
TUNING_STAGE = "FuseTIR"


def pass_name(compiler_pass: tvm.transform.Pass) -> str:
    return compiler_pass.info.name


def run_pipeline(
    mod: tvm.IRModule,
    target: CompileTarget,
    options: PipelineOptions = PipelineOptions(),
    dump_ir: str | Path | None = None,
    on_pass: Callable[[str], None] | None = None,
    stop_after: str | None = None,
    after_pass: Callable[[str, tvm.IRModule], None] | None = None,
) -> tuple[tvm.IRModule, list[dict]]:
    """Apply every pass of `passes()` in order; write `NN-<pass>.py` to `dump_ir` after each.

    Returns the lowered module and the seconds each pass took; `on_pass` hears each pass's name
    as it starts, `after_pass` gets its name and the module it made (a stage to look at without
    writing every one out). `stop_after` names the last pass to run (TUNING_STAGE: the kernels
    as tuning sees them).
    """
    pipeline = passes(target, options)
    if stop_after is not None:
        names = [pass_name(p) for p in pipeline]
        pipeline = pipeline[:names.index(stop_after) + 1]
    pass_times: list[dict] = []
    dump_dir = Path(dump_ir) if dump_ir is not None else None
    if dump_dir is not None:
        dump_dir.mkdir(parents=True, exist_ok=True)
        _write_ir(dump_dir / "00-imported.py", mod)
    with target.tvm_target, tvm.transform.PassContext(opt_level=3):
        for index, compiler_pass in enumerate(pipeline, start=1):
            name = pass_name(compiler_pass)
            if on_pass is not None:
                on_pass(name)
            started = time.perf_counter()
            try:
                mod = compiler_pass(mod)
            except Exception as err:  # TVM raises its own error types from C++
                first_line = (str(err).strip().splitlines() or [type(err).__name__])[-1]
                raise CompilationError(
                    f"pass {name} failed: {first_line}; rerun with --dump-ir DIR to see the IR "
                    "it got, and file an issue with that and the model"
                ) from err
            pass_times.append({"pass": name, "seconds": round(time.perf_counter() - started, 4)})
            if after_pass is not None:
                after_pass(name, mod)
            if dump_dir is not None:
                _write_ir(dump_dir / f"{index:02d}-{_file_stem(name)}.py", mod)
    return mod, pass_times


def _file_stem(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _write_ir(path: Path, mod: tvm.IRModule) -> None:
    path.write_text(mod.script(show_meta=False))


def split_weights(mod: tvm.IRModule) -> tuple[tvm.IRModule, list[WeightTensor]]:
    """Take the weights out of a lowered module: `main` keeps the code, the list the values.

    The values come from `main`'s `params` attribute in parameter order after the `num_input`
    model inputs, with the content keys PreTransformWeights recorded.
    """
    main = mod["main"]
    attrs = main.attrs or {}
    if "params" not in attrs:
        return mod, []
    num_input = int(attrs["num_input"])
    names = [param.name for param in main.params[num_input:]]
    keys = list(attrs.get("tightfit.weight_keys", [""] * len(names)))
    tensors = [WeightTensor(name, np.from_dlpack(value), str(key))
               for name, value, key in zip(names, attrs["params"], keys)]
    stripped = mod.clone()
    stripped["main"] = main.without_attr("params").without_attr("tightfit.weight_keys")
    return stripped, tensors


ALLOCATIONS = ("relax.vm.alloc_tensor", "relax.memory.alloc_tensor", "relax.builtin.alloc_tensor")


def _is_reshape_view(call: relax.Call) -> bool:
    """A reshape, before VM lowering (the op) or after (the VM builtin it becomes)."""
    if isinstance(call.op, tvm.ir.Op):
        return call.op.name == "relax.reshape"
    return isinstance(call.op, relax.ExternFunc) and call.op.global_symbol == "vm.builtin.reshape"


def fresh_outputs(mod: tvm.IRModule) -> list[bool]:
    """For each output of the lowered `main` (tuples flattened in order): whether the compiled code
    allocates it anew on every run, so a session may hand it to the caller without a copy.

    An output traced (through reshape views, match_casts and both branches of an `If`) to an
    allocation is fresh unless another output traces to the same allocation (handed out as two
    views, writing one would change the other). An output that is an input, a weight, a
    constant of the executable, or a view of one of them is not fresh: the caller could write
    into the model through it. Anything not traced to an allocation counts as not fresh.
    """
    main = mod["main"]
    values: dict[relax.Var, relax.Expr] = {}

    def record(seq: relax.SeqExpr) -> None:
        for block in seq.blocks:
            for binding in block.bindings:
                if isinstance(binding, (relax.VarBinding, relax.MatchCast)):
                    values[binding.var] = binding.value
                if isinstance(binding.value, relax.If):
                    record(binding.value.true_branch)
                    record(binding.value.false_branch)

    if isinstance(main.body, relax.SeqExpr):
        record(main.body)

    def resolve(expr: relax.Expr) -> relax.Expr:
        while isinstance(expr, relax.Var) and expr in values:
            expr = values[expr]
        return expr

    def allocation(expr: relax.Expr) -> relax.Expr | None:
        value = resolve(expr)
        if isinstance(value, relax.If):  # fresh when whichever branch runs allocates it
            branches_allocate = all(allocation(branch.body) is not None
                                    for branch in (value.true_branch, value.false_branch))
            return value if branches_allocate else None
        if not isinstance(value, relax.Call):
            return None
        if _is_reshape_view(value):
            return allocation(value.args[0])
        allocates = isinstance(value.op, tvm.ir.Op) and value.op.name in ALLOCATIONS
        return value if allocates else None

    def flatten(expr: relax.Expr) -> list[relax.Expr | None]:
        value = resolve(expr)
        if isinstance(value, relax.Tuple):
            return [found for field in value.fields for found in flatten(field)]
        return [allocation(value)]

    allocations = flatten(main.body.body if isinstance(main.body, relax.SeqExpr) else main.body)
    found = [allocated for allocated in allocations if allocated is not None]
    return [allocated is not None and sum(allocated.same_as(other) for other in found) == 1
            for allocated in allocations]
