"""The public entry points: `compile` an ONNX model into a Package, `load` a saved one."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import onnx
import tvm
from tvm import tirx

from .errors import CompilationError, CorruptPackageError, PackageError, StalePackageError
from .frontend import import_onnx
from .package import Package, SourceModel, load_package, read_manifest
from .passes.launch_kernel_sequences import kernel_calls, kernel_sequences
from .passes.share_identical_kernels import SHARED_COPIES_ATTR
from .passes.share_symbolic_storage import STORAGE_BYTES_ATTR
from .passes.write_scalars_to_shape_heap import HEAP_WRITER_ATTR
from .pipeline import PipelineOptions, build_config, fresh_outputs, run_pipeline, split_weights
from .target import resolve_target
from .vm_code import build_executable


def compile(  # noqa: A001 - the name users expect, as tvm.compile
    model: str | Path | onnx.ModelProto,
    target: str | dict = "host",
    *,
    input_shapes: dict[str, list[int | str]] | None = None,
    options: PipelineOptions = PipelineOptions(),
    dump_ir: str | Path | None = None,
    on_pass: Callable[[str], None] | None = None,
    after_pass: Callable[[str, tvm.IRModule], None] | None = None,
) -> Package:
    """Compile an ONNX model (a path or a ModelProto) for `target` ("host" or a TVM target dict).

    `input_shapes` fixes or renames input dims; `dump_ir` writes the IR after every pass to that
    directory, numbered in pipeline order; `on_pass` is called with each pass name as it starts,
    `after_pass` with each pass name and the IRModule it made (keep the stages you want to see).
    """
    compile_target = resolve_target(target)
    started = time.perf_counter()
    imported = import_onnx(model, input_shapes)
    proto = imported.onnx_model
    import_seconds = time.perf_counter() - started
    lowered, pass_times = run_pipeline(imported.mod, compile_target, options, dump_ir, on_pass,
                                       after_pass=after_pass)
    lowered, weights = split_weights(lowered)
    if on_pass is not None:
        on_pass("build")
    build_started = time.perf_counter()
    try:
        with tvm.transform.PassContext(opt_level=3, config=build_config(options)):
            executable = build_executable(lowered, compile_target.code_generation(options.fast_math))
    except Exception as err:  # TVM's C++ errors
        raise CompilationError(f"code generation failed: {str(err).strip().splitlines()[-1]}") from err
    pass_times.append({"pass": "build", "seconds": round(time.perf_counter() - build_started, 4)})
    sequences = kernel_sequences(lowered)
    report = {
        "import_seconds": round(import_seconds, 4),
        "compile_seconds": round(time.perf_counter() - started, 3),
        "passes": pass_times,
        # the kernels, not the sequences that call them nor the heap writers that call one
        "kernels": sum(isinstance(f, tirx.PrimFunc) and HEAP_WRITER_ATTR not in (f.attrs or {})
                       for f in lowered.functions.values()) - len(sequences),
        # the copies of kernels that repeated blocks made, each compiled once
        "shared_kernel_copies": int(lowered.get_attr(SHARED_COPIES_ATTR) or 0),
        # the kernel calls of each sequence that runs from one TIR function
        "kernel_sequences": [kernel_calls(sequence) for sequence in sequences.values()],
        "weights": len(weights),
        "weight_bytes": int(sum(w.value.nbytes for w in weights)),
        # the intermediate tensors' storages, each sized by an expression of the input dims
        "activation_storages": [str(size) for size in lowered["main"].attrs.get(STORAGE_BYTES_ATTR, [])],
    }
    source = (SourceModel.of_proto(proto) if isinstance(model, onnx.ModelProto)
              else SourceModel.of_file(model))
    return Package(
        executable=executable,
        weights=weights,
        inputs=imported.inputs,
        outputs=imported.outputs,
        fresh_outputs=fresh_outputs(lowered),
        target=compile_target.to_json(),
        source=source,
        compile_options={"input_shapes": input_shapes, "options": asdict(options)},
        report=report,
    )


def load(path: str | Path, source: str | Path | None = None, verify: bool = False) -> Package:
    """Open a package saved with `Package.save` (or `tightfit compile -o`).

    A stale package (another tightfit or TVM version, or a source model changed since) or a
    corrupt one is rebuilt from its source — `source`, or the path recorded at compile time if
    that file still exists — and saved in its place; with no source at hand it is refused with a
    PackageError. `verify` checks every weight blob against its hash.
    """
    try:
        return load_package(path, verify=verify, source=source)
    except (StalePackageError, CorruptPackageError) as problem:
        source_path = _rebuild_source(path, source)
        if source_path is None:
            raise PackageError(f"{problem}; no source model at hand to rebuild it: run "
                               f"`tightfit compile MODEL.onnx -o {path}`") from problem
        warnings.warn(f"rebuilding {path} from {source_path}: {problem}", stacklevel=2)
        manifest = read_manifest(path) if isinstance(problem, StalePackageError) else {}
        options = manifest.get("compile_options", {})
        target = manifest.get("target", {}).get("name", "host")
        rebuilt = compile(source_path, target, input_shapes=options.get("input_shapes"),
                          options=PipelineOptions(**options.get("options", {})))
        rebuilt.save(path)
        return load_package(path, verify=verify, source=source_path)


def _rebuild_source(path: str | Path, source: str | Path | None) -> Path | None:
    if source is not None:
        return Path(source) if Path(source).is_file() else None
    try:
        recorded = read_manifest(path)["source"]["path"]
    except (PackageError, KeyError):
        return None
    return Path(recorded) if recorded and Path(recorded).is_file() else None
