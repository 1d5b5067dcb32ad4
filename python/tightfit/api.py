"""The public entry points: `compile` an ONNX model into a Package, `load` a saved one."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import onnx
from tvm import relax, tirx

from .errors import CompilationError
from .frontend import import_onnx, load_onnx
from .package import Package, load_package, sha256_of_model
from .pipeline import PipelineOptions, run_pipeline
from .target import resolve_target


def compile(  # noqa: A001 - the name users expect, as tvm.compile
    model: str | Path | onnx.ModelProto,
    target: str | dict = "host",
    *,
    input_shapes: dict[str, list[int | str]] | None = None,
    options: PipelineOptions = PipelineOptions(),
    dump_ir: str | Path | None = None,
    on_pass: Callable[[str], None] | None = None,
) -> Package:
    """Compile an ONNX model (a path or a ModelProto) for `target` ("host" or a TVM target dict).

    `input_shapes` fixes or renames input dims; `dump_ir` writes the IR after every pass to that
    directory, numbered in pipeline order; `on_pass` is called with each pass name as it starts.
    """
    compile_target = resolve_target(target)
    proto = load_onnx(model)
    started = time.perf_counter()
    imported = import_onnx(proto, input_shapes)
    import_seconds = time.perf_counter() - started
    lowered, pass_times = run_pipeline(imported.mod, compile_target, options, dump_ir, on_pass)
    if on_pass is not None:
        on_pass("build")
    build_started = time.perf_counter()
    try:
        executable = relax.build(lowered, compile_target.tvm_target, relax_pipeline=None)
    except Exception as err:  # TVM's C++ errors
        raise CompilationError(f"code generation failed: {str(err).strip().splitlines()[-1]}") from err
    pass_times.append({"pass": "build", "seconds": round(time.perf_counter() - build_started, 4)})
    report = {
        "import_seconds": round(import_seconds, 4),
        "compile_seconds": round(time.perf_counter() - started, 3),
        "passes": pass_times,
        "kernels": sum(isinstance(f, tirx.PrimFunc) for f in lowered.functions.values()),
        "weights": len(imported.weights),
        "weight_bytes": int(sum(w.nbytes for w in imported.weights.values())),
    }
    return Package(
        executable=executable,
        weights=imported.weights,
        inputs=imported.inputs,
        outputs=imported.outputs,
        target=compile_target.to_json(),
        source_sha256=sha256_of_model(proto.SerializeToString()),
        report=report,
    )


def load(path: str | Path) -> Package:
    """Open a package saved with `Package.save` (or `tightfit compile -o`)."""
    return load_package(path)
