"""The `tightfit` command: compile, run, bench and inspect ONNX models.

Errors tightfit raises on purpose print as one line (`error: ...`) and exit with the error's
code (see `tightfit.errors`); `--verbose` adds the traceback. `--json` prints machine-readable
results on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "handler"):
        parser.print_help()
        return 2
    from .errors import TightfitError

    try:
        return args.handler(args)
    except TightfitError as err:
        if args.verbose:
            traceback.print_exc()
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tightfit", description=__doc__.splitlines()[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--verbose", action="store_true", help="print tracebacks of errors")
    common.add_argument("--json", action="store_true", help="print results as JSON on stdout")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    compile_cmd = commands.add_parser("compile", parents=[common], help="compile an ONNX model into a .tfpkg package")
    compile_cmd.add_argument("model", help="the ONNX file")
    compile_cmd.add_argument("-o", "--output", help="package directory to write (default: MODEL with .tfpkg)")
    _add_target_options(compile_cmd)
    compile_cmd.add_argument("--dump-ir", metavar="DIR", help="write the IR after every pass to DIR, numbered in order")
    compile_cmd.set_defaults(handler=_compile)

    run_cmd = commands.add_parser("run", parents=[common], help="run a model (.onnx or .tfpkg) on the host")
    run_cmd.add_argument("model", help="an ONNX file (compiled first) or a .tfpkg package")
    run_cmd.add_argument("--inputs", metavar="NPZ", help="inputs as a .npz file (default: random)")
    _add_target_options(run_cmd)
    run_cmd.add_argument("--check", action="store_true", help="compare the outputs with onnxruntime")
    run_cmd.add_argument("--reference", metavar="ONNX", help="ONNX file for --check when running a .tfpkg")
    run_cmd.add_argument("--tolerance", type=float, default=1e-4, help="max abs error --check accepts (default 1e-4)")
    run_cmd.add_argument("--save-outputs", metavar="NPZ", help="write the outputs to a .npz file")
    run_cmd.set_defaults(handler=_run)

    bench_cmd = commands.add_parser("bench", parents=[common], help="time tightfit against onnxruntime and TVM's default build")
    bench_cmd.add_argument("model", nargs="?", help="an ONNX file or a built-in example name "
                           "(convnet_dynamic, vgg_style), or use --zoo")
    bench_cmd.add_argument("--shapes", action="append", metavar="SPEC", default=[],
                           help="one input shape set, e.g. 'x=1,3,64,64' or 'ids=2,16;mask=2,16'; repeat for more")
    bench_cmd.add_argument("--zoo", nargs="*", metavar="NAME", help="benchmark the built-in zoo models (all, or NAMEs)")
    bench_cmd.add_argument("--repeat", type=int, default=20, help="timed runs per engine and shape (default 20)")
    bench_cmd.add_argument("--no-memory", action="store_true", help="skip the peak-RSS subprocess measurements")
    bench_cmd.add_argument("--loading", action="store_true",
                           help="measure time to a ready session and peak RSS at load instead of latency")
    bench_cmd.add_argument("--out", metavar="DIR", default="bench/results", help="where bench.json and bench.md go")
    bench_cmd.set_defaults(handler=_bench)

    conformance_cmd = commands.add_parser("conformance", parents=[common],
                                          help="run the ONNX backend node tests (shipped in onnx)")
    conformance_cmd.add_argument("--engine", choices=["tightfit", "tvm"], default="tightfit",
                                 help="tightfit, or stock TVM for comparison (default tightfit)")
    conformance_cmd.add_argument("--pattern", help="only cases whose name matches this regular expression")
    conformance_cmd.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    conformance_cmd.add_argument("--out", metavar="FILE", help="write every case's result as JSON")
    conformance_cmd.set_defaults(handler=_conformance)

    inspect_cmd = commands.add_parser("inspect", parents=[common], help="show the pipeline and the imported model's ops")
    inspect_cmd.add_argument("model", help="the ONNX file")
    _add_target_options(inspect_cmd)
    inspect_cmd.add_argument("--rdp", action="store_true",
                             help="add each tensor's dynamism class and RDP value (before/after) and SoD2's summary")
    inspect_cmd.set_defaults(handler=_inspect)
    return parser


def _add_target_options(command: argparse.ArgumentParser) -> None:
    command.add_argument("--target", default="host", help="'host' or a TVM target as JSON (default host)")
    command.add_argument("--shape", action="append", default=[], metavar="NAME=DIMS",
                         help="fix or name an input's dims, e.g. x=1,3,H,W (repeatable)")


def _shape_options(args) -> dict[str, list[int | str]]:
    from .feeds import parse_shape_option

    return dict(parse_shape_option(text) for text in args.shape)


def _compile(args) -> int:
    from tqdm import tqdm

    from .api import compile as tightfit_compile
    from .pipeline import PipelineOptions, passes
    from .target import resolve_target

    target = resolve_target(args.target)
    output = Path(args.output) if args.output else Path(args.model).with_suffix(".tfpkg")
    with tqdm(total=len(passes(target, PipelineOptions())) + 1, desc="compile", unit="pass",
              file=sys.stderr, disable=None) as progress:
        def advance(name: str) -> None:
            progress.set_postfix_str(name)
            progress.update(1)

        package = tightfit_compile(args.model, target, input_shapes=_shape_options(args),
                                   dump_ir=args.dump_ir, on_pass=advance)
    package.save(output)
    weight_file = package.report["weight_file"]
    summary = {"package": str(output), "compile_seconds": package.report["compile_seconds"],
               "kernels": package.report["kernels"], "weight_file": weight_file}
    _emit(args, summary, f"wrote {output} ({summary['kernels']} kernels, "
                         f"{weight_file['payload_bytes'] / 1e6:.2f} MB of weights in "
                         f"{weight_file['blobs']} blobs, {weight_file['dedup_saved_bytes'] / 1e6:.2f} MB "
                         f"saved by dedup, {summary['compile_seconds']:.1f} s)")
    return 0


def _run(args) -> int:
    from .api import compile as tightfit_compile
    from .api import load
    from .errors import InputError
    from .feeds import concrete_shapes, load_npz, max_abs_error, random_feeds, run_onnxruntime

    model_path = Path(args.model)
    if model_path.is_dir():
        package = load(model_path)
        reference = args.reference
    else:
        package = tightfit_compile(model_path, args.target, input_shapes=_shape_options(args))
        reference = args.reference or model_path
    if args.inputs:
        feeds = load_npz(args.inputs)
    else:
        feeds = random_feeds(package.inputs, concrete_shapes(package.inputs, _shape_options(args)))
    outputs = package.session().run(feeds)
    if args.save_outputs:
        np.savez(args.save_outputs, **outputs)
    summary = {"outputs": {name: {"shape": list(value.shape), "dtype": str(value.dtype)}
                           for name, value in outputs.items()}}
    lines = [f"{name}: shape {value.shape} {value.dtype}" for name, value in outputs.items()]
    status = 0
    if args.check:
        if reference is None:
            raise InputError("--check on a .tfpkg needs the source model: add --reference MODEL.onnx")
        error = max_abs_error(outputs, run_onnxruntime(reference, feeds))
        ok = error <= args.tolerance
        summary["check"] = {"max_abs_error": error, "tolerance": args.tolerance, "ok": ok}
        lines.append(f"check against onnxruntime: max abs error {error:.3g} "
                     f"({'ok' if ok else 'FAILED'}, tolerance {args.tolerance:g})")
        status = 0 if ok else 1
    _emit(args, summary, "\n".join(lines))
    return status


def _bench(args) -> int:
    from .errors import InputError
    from .feeds import parse_shape_option

    jobs = []
    if args.zoo is not None:
        from .testing import zoo

        for name in args.zoo or zoo.names():
            entry = zoo.get(name)
            jobs.append((name, entry.build(), entry.shape_sets, entry.feeds))
    elif args.model:
        shape_sets = [dict((n, tuple(d)) for n, d in map(parse_shape_option, spec.split(";")))
                      for spec in args.shapes]
        if not shape_sets and not args.loading:
            raise InputError("give at least one --shapes SPEC, e.g. --shapes x=1,3,64,64")
        jobs.append((Path(args.model).stem, _bench_model(args.model), shape_sets, None))
    else:
        raise InputError("name a model or use --zoo")
    if args.loading:
        return _bench_loading(args, jobs)
    from .bench import benchmark_model, markdown_table, write_reports

    results = []
    for name, model, shape_sets, feeds_for in jobs:
        print(f"bench {name} ...", file=sys.stderr, flush=True)
        results.append(benchmark_model(model, shape_sets, name=name, repeat=args.repeat,
                                       measure_memory=not args.no_memory, feeds_for=feeds_for))
    json_path, markdown_path = write_reports(results, args.out)
    _emit(args, json.loads(json_path.read_text()),
          markdown_table(results) + f"\n\nwrote {json_path} and {markdown_path}")
    return 0


def _bench_model(name: str):
    """A path to an ONNX file, or the name of a built-in example model (built from code)."""
    from .examples.make_examples import BUILTIN

    return BUILTIN[name]() if name in BUILTIN and not Path(name).exists() else name


def _bench_loading(args, jobs) -> int:
    from .bench_loading import benchmark_loading, loading_table, write_loading_reports

    results = []
    for name, model, shape_sets, _ in jobs:
        print(f"bench loading {name} ...", file=sys.stderr, flush=True)
        results.append(benchmark_loading(model, name, shape_sets[0] if shape_sets else None))
    path = write_loading_reports(results, args.out)
    _emit(args, json.loads((path.parent / "loading.json").read_text()),
          loading_table(results) + f"\n\nwrote {path}")
    return 0


def _conformance(args) -> int:
    from .conformance import per_op_table, run_node_tests, summarize

    results = run_node_tests(args.engine, args.pattern, args.jobs, args.out)
    _emit(args, summarize(results), per_op_table(results))
    return 0


def _inspect(args) -> int:
    from .frontend import import_onnx
    from .inspection import format_table, op_table, pipeline_table
    from .target import resolve_target

    imported = import_onnx(args.model, _shape_options(args))
    pipeline = pipeline_table(resolve_target(args.target))
    ops = op_table(imported.mod)
    text = "\n".join([
        "inputs: " + ", ".join(f"{s.name} {s.shape} {s.dtype}" for s in imported.inputs),
        "outputs: " + ", ".join(f"{s.name} {s.shape} {s.dtype}" for s in imported.outputs),
        "", "pipeline:", format_table(pipeline), "", f"imported ops ({len(ops)}):",
        format_table(ops, ["binding", "op", "inputs", "output", "dtype"]),
    ])
    data = {"pipeline": pipeline, "ops": ops,
            "inputs": [s.to_json() for s in imported.inputs],
            "outputs": [s.to_json() for s in imported.outputs]}
    if args.rdp:
        from .dynamism import format_report, rdp_report

        report = rdp_report(imported)
        data["rdp"] = report.to_json()
        text += "\n\ndynamism classes and RDP (SoD2 §3, §4.1):\n" + format_report(report)
    _emit(args, data, text)
    return 0


def _emit(args, data, text: str) -> None:
    print(json.dumps(data, indent=2, default=str) if args.json else text)


if __name__ == "__main__":
    sys.exit(main())
