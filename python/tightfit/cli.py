"""The `tightfit` command: compile, run, bench, inspect and tune ONNX models; devices over RPC.

Errors tightfit raises on purpose print as one line (`error: ...`) and exit with the error's
code (see `tightfit.errors`); `--verbose` adds the traceback. `--json` prints machine-readable
results on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from pathlib import Path

import numpy as np


def entry_point() -> None:
    """The `tightfit` command (and `python -m tightfit.cli`): `main` in a process of its own,
    which imports torch only for the zoo's PyTorch-exported models."""
    sys.exit(main(torch_only_for_the_zoo=True))


def main(argv: list[str] | None = None, torch_only_for_the_zoo: bool = False) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "handler"):
        parser.print_help()
        return 2
    if torch_only_for_the_zoo and getattr(args, "zoo", None) is None:
        from .fresh_process import forbid_torch

        forbid_torch()
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
    compile_cmd.add_argument("--db", metavar="DIR", help="a tuning database (`tightfit tune --db DIR`) whose records "
                             "schedule the kernels they match")
    compile_cmd.add_argument("--check-kernel-arguments", action="store_true",
                             help="keep TVM's checks of each kernel's arguments (shapes, strides, alignment) "
                             "as it is called: to debug a crash inside a model; slower to build and load")
    _add_knobs_option(compile_cmd)
    compile_cmd.set_defaults(handler=_compile)

    run_cmd = commands.add_parser("run", parents=[common], help="run a model (.onnx or .tfpkg) on the host")
    run_cmd.add_argument("model", help="an ONNX file (compiled first) or a .tfpkg package")
    run_cmd.add_argument("--inputs", metavar="NPZ", help="inputs as a .npz file (default: random)")
    _add_target_options(run_cmd)
    run_cmd.add_argument("--check", action="store_true", help="compare the outputs with onnxruntime")
    run_cmd.add_argument("--reference", metavar="ONNX", help="ONNX file for --check when running a .tfpkg")
    run_cmd.add_argument("--tolerance", type=float, default=1e-4, help="max abs error --check accepts (default 1e-4)")
    run_cmd.add_argument("--save-outputs", metavar="NPZ", help="write the outputs to a .npz file")
    run_cmd.add_argument("--profile", action="store_true",
                         help="time each kernel on this run's arguments and show where the time goes")
    _add_knobs_option(run_cmd)
    _add_rpc_options(run_cmd)
    run_cmd.set_defaults(handler=_run)

    bench_cmd = commands.add_parser("bench", parents=[common], help="time tightfit against onnxruntime and TVM's default build")
    bench_cmd.add_argument("model", nargs="?", help="an ONNX file or a built-in example name "
                           "(convnet_dynamic, vgg_style), or use --zoo")
    bench_cmd.add_argument("--shapes", action="append", metavar="SPEC", default=[],
                           help="one input shape set, e.g. 'x=1,3,64,64' or 'ids=2,16;mask=2,16'; repeat for more")
    bench_cmd.add_argument("--zoo", nargs="*", metavar="NAME", help="benchmark the built-in zoo models (all, or NAMEs)")
    # the zoo's models run in tens of microseconds: medians of 20 runs moved by 10-20% between
    # benchmark runs on this shared 2-core machine
    bench_cmd.add_argument("--repeat", type=int, default=40,
                           help="timed runs per engine and shape (default 40)")
    bench_cmd.add_argument("--no-memory", action="store_true", help="skip the peak-RSS subprocess measurements")
    bench_cmd.add_argument("--loading", action="store_true",
                           help="measure time to a ready session and peak RSS at load instead of latency")
    bench_cmd.add_argument("--roofline", action="store_true",
                           help="time each model's largest conv and GEMM alone against this CPU's "
                           "measured peak and memory bandwidth (with the whole zoo: also ResNet-50's "
                           "3x3 conv and a BERT-base GEMM); writes roofline.md/.json/.png")
    bench_cmd.add_argument("--out", metavar="DIR", default="bench/results", help="where bench.json and bench.md go")
    _add_knobs_option(bench_cmd)
    _add_rpc_options(bench_cmd)
    bench_cmd.set_defaults(handler=_bench)

    search_cmd = commands.add_parser("search", parents=[common],
                                     help="time each conv's candidate algorithms and each kernel's register "
                                          "tiles on the target; keep them in a knob database for `compile --knobs`")
    search_cmd.add_argument("model", help="the ONNX file")
    search_cmd.add_argument("--target", default="host",
                            help="'host', a device preset, a device .json file, or a TVM target as JSON")
    search_cmd.add_argument("--shapes", metavar="SPEC", default="",
                            help="the input shapes to time at, e.g. 'x=1,3,64,64' or 'ids=2,16;mask=2,16' "
                                 "(needed where inputs have dynamic dims; the model stays dynamic)")
    search_cmd.add_argument("--knobs", metavar="FILE", required=True,
                            help="the knob database (JSON) to update (created if missing)")
    search_cmd.add_argument("--plot", metavar="PNG",
                            help="also draw each conv candidate's estimated against its measured time")
    search_cmd.add_argument("--tiles", type=int, default=12, metavar="N",
                            help="register tiles timed per kernel bucket after the conv algorithms, and the "
                                 "parallel threshold measured (default 12; 0: conv algorithms only)")
    search_cmd.add_argument("--remeasure", action="store_true",
                            help="time again what the knob database already holds (default: keep it and "
                                 "time only what is missing, so a search cut off midway goes on)")
    _add_rpc_options(search_cmd)
    search_cmd.set_defaults(handler=_search)

    tune_cmd = commands.add_parser("tune", parents=[common],
                                   help="tune a model's kernels on a device over RPC (MetaSchedule; resumable)")
    tune_cmd.add_argument("model", help="the ONNX file")
    _add_target_options(tune_cmd)
    tune_cmd.add_argument("--rpc-tracker", metavar="HOST:PORT", required=True, help="the RPC tracker")
    tune_cmd.add_argument("--rpc-key", metavar="KEY", required=True, help="the device key; every device under it measures")
    tune_cmd.add_argument("--trials", type=int, default=64, help="total trials the database should hold (default 64); "
                          "a rerun measures only what is missing")
    tune_cmd.add_argument("--db", metavar="DIR", required=True, help="the tuning database folder (created if missing)")
    tune_cmd.add_argument("--session-timeout", type=float, default=60.0, metavar="S",
                          help="seconds a device may spend on one candidate's session (default 60)")
    tune_cmd.add_argument("--batch", type=int, default=16, metavar="N",
                          help="candidates measured per batch; records are saved after each (default 16)")
    tune_cmd.set_defaults(handler=_tune)

    devices_cmd = commands.add_parser("devices", parents=[common],
                                      help="list device presets, and with --rpc-tracker what a tracker has")
    devices_cmd.add_argument("--rpc-tracker", metavar="HOST:PORT", help="also list the tracker's keys and queues")
    devices_cmd.set_defaults(handler=_devices)

    device_cmd = commands.add_parser("device", parents=[common], help="manage devices (the emulated Arm64 device)")
    device_commands = device_cmd.add_subparsers(title="device commands", metavar="COMMAND")
    emulate_cmd = device_commands.add_parser("emulate", parents=[common],
                                             help="start (or --stop) an emulated Arm64 device on a tracker")
    emulate_cmd.add_argument("--key", required=True, help="the device key to register under")
    emulate_cmd.add_argument("--rpc-tracker", metavar="HOST:PORT", default="127.0.0.1:9190",
                             help="the tracker (default 127.0.0.1:9190; started here if none answers on loopback)")
    emulate_cmd.add_argument("--threads", type=int, default=2, help="threads the device runs kernels on (default 2)")
    emulate_cmd.add_argument("--stop", action="store_true", help="stop the devices started here under KEY")
    emulate_cmd.set_defaults(handler=_device_emulate)

    conformance_cmd = commands.add_parser("conformance", parents=[common],
                                          help="run the ONNX backend node tests (shipped in onnx)")
    conformance_cmd.add_argument("--engine", choices=["tightfit", "tvm"], default="tightfit",
                                 help="tightfit, or stock TVM for comparison (default tightfit)")
    conformance_cmd.add_argument("--pattern", help="only cases whose name matches this regular expression")
    conformance_cmd.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    conformance_cmd.add_argument("--out", metavar="FILE", help="write every case's result as JSON")
    conformance_cmd.add_argument("--cases", metavar="FILE",
                                 help="only the cases this file names, e.g. tests/data/onnx_node_passing.txt")
    conformance_cmd.add_argument("--per-op", type=int, metavar="N",
                                 help="at most N cases of each op, spread over its cases (what CI runs: 4)")
    conformance_cmd.set_defaults(handler=_conformance)

    inspect_cmd = commands.add_parser("inspect", parents=[common], help="show the pipeline and the imported model's ops")
    inspect_cmd.add_argument("model", help="the ONNX file")
    _add_target_options(inspect_cmd)
    inspect_cmd.add_argument("--rdp", action="store_true",
                             help="add each tensor's dynamism class and RDP value (before/after) and SoD2's summary")
    inspect_cmd.set_defaults(handler=_inspect)
    return parser


def _add_target_options(command: argparse.ArgumentParser) -> None:
    command.add_argument("--target", default="host",
                         help="'host', a device preset (see `tightfit devices`), a device .json file, "
                              "or a TVM target as JSON (default host)")
    command.add_argument("--shape", action="append", default=[], metavar="NAME=DIMS",
                         help="fix or name an input's dims, e.g. x=1,3,H,W (repeatable)")


def _add_knobs_option(command: argparse.ArgumentParser) -> None:
    command.add_argument("--knobs", metavar="FILE",
                         help="a knob database (`tightfit search --knobs FILE`): convs take the algorithm "
                              "measured fastest there (default: $TIGHTFIT_KNOB_DATABASE, else the cost model)")


def _add_rpc_options(command: argparse.ArgumentParser) -> None:
    command.add_argument("--rpc-tracker", metavar="HOST:PORT", help="run on a device through this RPC tracker")
    command.add_argument("--rpc-key", metavar="KEY", help="the device key at the tracker (with --rpc-tracker)")
    command.add_argument("--session-timeout", type=float, default=600.0, metavar="S",
                         help="seconds the device keeps the RPC session (default 600)")


def _session_for(args, package):
    """A session on the host, or on the device named by --rpc-tracker/--rpc-key."""
    from .errors import InputError

    if not args.rpc_tracker:
        if args.rpc_key:
            raise InputError("--rpc-key needs --rpc-tracker HOST:PORT")
        return package.session()
    if not args.rpc_key:
        raise InputError("--rpc-tracker needs --rpc-key KEY (the device key; `tightfit devices "
                         f"--rpc-tracker {args.rpc_tracker}` lists them)")
    print(f"opening a session on {args.rpc_key!r} via {args.rpc_tracker} ...", file=sys.stderr, flush=True)
    return package.remote_session(args.rpc_tracker, args.rpc_key, args.session_timeout)


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
    options = PipelineOptions(tuning_database=args.db, knob_database=args.knobs,
                              kernel_argument_checks=args.check_kernel_arguments)
    with tqdm(total=len(passes(target, options)) + 1, desc="compile", unit="pass",
              file=sys.stderr, disable=None) as progress:
        def advance(name: str) -> None:
            progress.set_postfix_str(name)
            progress.update(1)

        package = tightfit_compile(args.model, target, input_shapes=_shape_options(args),
                                   options=options, dump_ir=args.dump_ir, on_pass=advance)
    package.save(output)
    weight_file = package.report["weight_file"]
    storages = package.report["activation_storages"]
    summary = {"package": str(output), "compile_seconds": package.report["compile_seconds"],
               "kernels": package.report["kernels"],
               "shared_kernel_copies": package.report["shared_kernel_copies"], "activation_storages": storages,
               "weight_file": weight_file}
    sequences = package.report["kernel_sequences"]
    summary["kernel_sequences"] = sequences
    kernels = f"{summary['kernels']} kernels"
    if summary["shared_kernel_copies"]:
        kernels += f" ({summary['shared_kernel_copies']} repeats of them compiled once)"
    _emit(args, summary, f"wrote {output} ({kernels}, {sum(sequences)} of their "
                         f"calls in {len(sequences)} sequence{'' if len(sequences) == 1 else 's'}, "
                         f"intermediate tensors in {len(storages)} storages, "
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
        reference = args.reference or package.source.path
    else:
        from .pipeline import PipelineOptions

        package = tightfit_compile(model_path, args.target, input_shapes=_shape_options(args),
                                   options=PipelineOptions(knob_database=args.knobs))
        reference = args.reference or model_path
    if args.inputs:
        feeds = load_npz(args.inputs)
    else:
        feeds = random_feeds(package.inputs, concrete_shapes(package.inputs, _shape_options(args)))
    session = _session_for(args, package)
    outputs = session.run(feeds)
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
    if args.profile:
        profile = session.profile(feeds)
        summary["profile"] = profile.as_json()
        lines.append(profile.table())
    _emit(args, summary, "\n".join(lines))
    return status


def _bench(args) -> int:
    from .errors import InputError
    from .feeds import parse_shape_option
    from .schedules.knob_database import ENV_VARIABLE

    if args.knobs:  # every tightfit compile of the benchmark, its memory workers' too, reads it
        os.environ[ENV_VARIABLE] = str(Path(args.knobs).resolve())
    if args.rpc_tracker or args.rpc_key:
        return _bench_remote(args)
    jobs = []
    if args.zoo is not None:
        from .testing import zoo

        unknown = sorted(set(args.zoo) - set(zoo.names()))
        if unknown:
            raise InputError(f"the zoo has no model {', '.join(unknown)}; its models: {', '.join(zoo.names())}")
        for name in args.zoo or zoo.names():
            entry = zoo.get(name)
            jobs.append((name, entry.build(), entry.shape_sets, entry.feeds))
    elif args.model:
        shape_sets = [dict((n, tuple(d)) for n, d in map(parse_shape_option, spec.split(";")))
                      for spec in args.shapes]
        if not shape_sets and not (args.loading or args.roofline):
            raise InputError("give at least one --shapes SPEC, e.g. --shapes x=1,3,64,64")
        jobs.append((Path(args.model).stem, _bench_model(args.model), shape_sets, None))
    else:
        raise InputError("name a model or use --zoo")
    if args.loading:
        return _bench_loading(args, jobs)
    if args.roofline:
        return _bench_roofline(args, jobs, with_reference_layers=args.zoo == [])
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


def _bench_roofline(args, jobs, with_reference_layers: bool) -> int:
    from .bench_roofline import (benchmark_roofline, largest_layers, reference_layers,
                                 roofline_table, write_roofline_reports)
    from .errors import InputError
    from .feeds import concrete_shapes, random_feeds
    from .frontend import declared_inputs, load_onnx

    layers = []
    for name, model, shape_sets, feeds_for in jobs:
        proto = load_onnx(model)
        specs = declared_inputs(proto.graph)
        if not shape_sets:  # a static model needs none; a dynamic one is not guessed at
            shape_sets = [concrete_shapes(specs, {}, option="--shapes")]
        # the shape set with the most input elements: the layers at their largest
        shapes = max(shape_sets,
                     key=lambda shape_set: sum(math.prod(dims) for dims in shape_set.values()))
        feeds = (feeds_for or (lambda shape_set: random_feeds(specs, shape_set)))(shapes)
        layers += largest_layers(name, proto, feeds)
    if with_reference_layers:
        layers += reference_layers()
    if not layers:
        raise InputError("no Conv, MatMul or Gemm node in the model's top-level graph: nothing "
                         "for a roofline")
    report = benchmark_roofline(layers, repeat=args.repeat)
    written = write_roofline_reports(report, args.out)
    _emit(args, json.loads(written[0].read_text()),
          roofline_table(report) + "\n\nwrote " + ", ".join(map(str, written)))
    return 0


def _bench_remote(args) -> int:
    """Latency on a device: a compiled package (or an ONNX file compiled for --target) timed by
    TVM's time_evaluator on the device, outputs checked against onnxruntime on the host."""
    from .api import compile as tightfit_compile
    from .api import load
    from .errors import InputError
    from .feeds import concrete_shapes, max_abs_error, parse_shape_option, random_feeds, run_onnxruntime

    if not args.model:
        raise InputError("bench on a device needs a model: a .tfpkg compiled for it, or an ONNX file and --target")
    model_path = Path(args.model)
    package = load(model_path) if model_path.is_dir() else tightfit_compile(model_path, args.target)
    reference = package.source.path if model_path.is_dir() else model_path
    session = _session_for(args, package)
    rows = []
    for spec in args.shapes or [""]:
        shapes = dict((n, tuple(d)) for n, d in map(parse_shape_option, filter(None, spec.split(";"))))
        feeds = random_feeds(package.inputs, concrete_shapes(package.inputs, shapes))
        outputs = session.run(feeds)
        error = max_abs_error(outputs, run_onnxruntime(reference, feeds)) if reference else None
        seconds = sorted(session.time_run(feeds, repeat=args.repeat))
        rows.append({"shape": "; ".join(f"{name}={'x'.join(map(str, value.shape))}" for name, value in feeds.items()),
                     "device ms": round(1e3 * seconds[len(seconds) // 2], 4), "runs": len(seconds),
                     "max abs err vs ORT": error})
    from .inspection import format_table

    data = {"device": args.rpc_key, "tracker": args.rpc_tracker, "target": package.target["name"],
            "session_open_seconds": round(session.remote.open_seconds, 3), "rows": rows,
            "peak_memory": "not reported: TVM's RPC server has no memory query"}
    _emit(args, data, f"{args.rpc_key} ({package.target['name']}), session opened in "
                      f"{session.remote.open_seconds:.2f} s; median of {args.repeat} runs timed on the device\n"
                      + format_table(rows))
    return 0


def _search(args) -> int:
    from dataclasses import asdict

    from tqdm import tqdm

    from .algorithm_search import plot_timings, search_conv_algorithms, timing_table
    from .errors import DeviceError, InputError
    from .feeds import concrete_shapes, parse_shape_option
    from .frontend import declared_inputs, load_onnx
    from .inspection import format_table
    from .schedules import knob_search
    from .schedules.knob_database import KnobDatabase
    from .target import resolve_target

    if bool(args.rpc_tracker) != bool(args.rpc_key):
        raise InputError("--rpc-tracker HOST:PORT and --rpc-key KEY go together (`tightfit devices "
                         "--rpc-tracker HOST:PORT` lists the keys)")
    target = resolve_target(args.target)
    if not args.rpc_tracker and not target.runs_on_host:
        raise InputError(f"{target.name} kernels can only be timed on the device: add --rpc-tracker HOST:PORT "
                         "--rpc-key KEY (for the emulated device: `tightfit device emulate --key KEY`)")
    given = dict(parse_shape_option(text) for text in filter(None, args.shapes.split(";")))
    shapes = concrete_shapes(declared_inputs(load_onnx(args.model).graph), given, option="--shapes")
    remote = None
    if args.rpc_tracker:
        from .device_rpc import remote as rpc
        from .device_rpc.tracker import TrackerAddress

        print(f"opening a session on {args.rpc_key!r} via {args.rpc_tracker} ...", file=sys.stderr, flush=True)
        remote = rpc.connect(TrackerAddress.parse(args.rpc_tracker), args.rpc_key, args.session_timeout)
    with tqdm(desc="search", unit="candidate", file=sys.stderr, disable=None) as bar:
        def progress(note: str) -> None:
            bar.set_postfix_str(note)
            bar.update(1)

        try:
            timings = search_conv_algorithms(args.model, shapes, args.knobs, target, remote, progress,
                                             args.remeasure)
            tiles = (knob_search.search(args.model, args.knobs, shapes, args.tiles, target, remote, progress,
                                        args.remeasure)
                     if args.tiles > 0 else {})
        except RuntimeError as err:  # TVM's RPC errors: the device failed or went away
            if remote is None:
                raise
            raise DeviceError(f"timing on {args.rpc_key!r} failed: {str(err).strip().splitlines()[-1]}; "
                              f"the convs timed before are kept in {args.knobs}: check the device "
                              "(`tightfit devices --rpc-tracker ...`) and run the same command again, which "
                              "times only what is missing") from err
    changed = [t for t in timings if t.measured_choice != t.estimated_choice]
    if args.plot:
        plot_timings(timings, args.plot)
    tile_rows = [{"bucket": bucket, **asdict(result["knobs"]), "us": result["us"], "tried": result["tried"],
                  "measured_before": result["measured_before"]}
                 for bucket, result in tiles.items()]
    threshold = KnobDatabase.open(args.knobs, target.tvm_target).min_parallel_work()
    data = {"knobs": args.knobs, "convs": [asdict(t) for t in timings], "tiles": tile_rows,
            "min_parallel_work": threshold if tiles else None}
    earlier_convs = sum(t.measured_before for t in timings)
    earlier_buckets = sum(r["measured_before"] for r in tiles.values())
    text = timing_table(timings) + f"\n\n{len(timings)} conv shape(s), {len(changed)} choice(s) differ " \
                                    "from the cost model's"
    if earlier_convs or earlier_buckets:
        text += (f"\n{earlier_convs} conv shape(s) and {earlier_buckets} tile bucket(s) were in {args.knobs} "
                 "already and were not timed again (--remeasure times them again)")
    if tiles:
        text += "\n\n" + format_table(tile_rows) + f"\n\nparallel threshold: {threshold} loop iterations"
    _emit(args, data, text + f"\n\nrecorded in {args.knobs}: compile with "
                             f"`tightfit compile {args.model} --target {args.target} --knobs {args.knobs}`")
    return 0


def _tune(args) -> int:
    from tqdm import tqdm

    from .device_rpc.tracker import TrackerAddress
    from .device_rpc.tuning import TuningSession, tune
    from .errors import InputError
    from .frontend import import_onnx
    from .pipeline import TUNING_STAGE, PipelineOptions, run_pipeline
    from .target import resolve_target

    target = resolve_target(args.target)
    imported = import_onnx(args.model, _shape_options(args))
    dynamic = [f"{spec.name} {list(spec.shape)}" for spec in imported.inputs
               if not all(isinstance(dim, int) for dim in spec.shape)]
    if dynamic:
        raise InputError(f"tuning measures static shapes; fix the dynamic inputs {', '.join(dynamic)} with "
                         "--shape NAME=DIMS (one shape bucket per session; sessions can share one --db)")
    mod, _ = run_pipeline(imported.mod, target, PipelineOptions(), stop_after=TUNING_STAGE)
    fcompile = None
    if target.cross_compiler:
        from .device_rpc.devices import export_function

        fcompile = export_function(target.cross_compiler, target.name)
    session = TuningSession(TrackerAddress.parse(args.rpc_tracker), args.rpc_key, target.tvm_target,
                            lambda module, path: module.export_library(path, fcompile=fcompile),
                            session_timeout_s=args.session_timeout)
    with tqdm(total=args.trials, desc="tune", unit="trial", file=sys.stderr, disable=None) as bar:
        def progress(report, note: str) -> None:
            bar.n = min(args.trials, report.recorded_before + report.measured + report.failed)
            best = sum(report.best_ms.values())
            bar.set_postfix_str(f"best {best:.3f} ms over {len(report.best_ms)} kernel(s)" if report.best_ms else note)
            if "lost their session" in note:
                bar.write(note)
            bar.refresh()

        report = tune(mod, session, args.db, args.trials, progress, trials_per_batch=args.batch)
    from dataclasses import asdict

    data = {**asdict(report), "trials_per_minute": round(report.trials_per_minute, 1)}
    _emit(args, data, f"tuned {len(report.tasks)} kernel(s) on {args.rpc_key!r} ({report.devices} device(s)): "
                      f"{report.measured} measured, {report.failed} failed, {report.skipped_already_measured} "
                      f"skipped as already measured, in {report.seconds:.0f} s "
                      f"({report.trials_per_minute:.1f} trials/min); the database {args.db} now holds "
                      f"{report.recorded_before + report.measured + report.failed} records; use it with "
                      f"`tightfit compile {args.model} --target {args.target} --db {args.db}`")
    return 0


def _devices(args) -> int:
    from .device_rpc.devices import load_device, preset_names
    from .inspection import format_table

    presets = []
    for name in preset_names():
        device = load_device(name)
        target = device.target
        presets.append({"preset": name, "triple": target.get("mtriple", "host"), "cpu": target.get("mcpu", ""),
                        "features": " ".join(target.get("mattr", [])), "threads": target.get("num-cores", ""),
                        "cores": " + ".join(f"{c.count}x {c.core}" for c in device.clusters),
                        "memory MB": device.memory_mb or ""})
    data = {"presets": presets}
    text = "device presets (use with --target):\n" + format_table(presets)
    if args.rpc_tracker:
        from dataclasses import asdict

        from .device_rpc.tracker import TrackerAddress, key_queues

        queues = [asdict(queue) for queue in key_queues(TrackerAddress.parse(args.rpc_tracker))]
        data["tracker"] = {"address": args.rpc_tracker, "keys": queues}
        text += f"\n\ntracker {args.rpc_tracker}:\n" + (format_table(queues) if queues else "(no devices)")
    _emit(args, data, text)
    return 0


def _device_emulate(args) -> int:
    from .device_rpc import emulated
    from .device_rpc.tracker import TrackerAddress

    tracker = TrackerAddress.parse(args.rpc_tracker)
    if args.stop:
        stopped = emulated.stop(args.key)
        _emit(args, {"stopped": [server.pid for server in stopped]},
              f"stopped {len(stopped)} emulated device(s) under {args.key!r}" if stopped
              else f"no emulated device under {args.key!r} was running")
        return 0
    started_tracker = emulated.ensure_tracker(tracker, progress=lambda line: print(line, file=sys.stderr))
    server = emulated.start(args.key, tracker, args.threads,
                            progress=lambda line: print(line, file=sys.stderr, flush=True))
    data = {"key": args.key, "pid": server.pid, "port": server.port, "tracker": str(tracker),
            "started_seconds": round(server.started_s, 1), "log": server.log,
            "started_tracker": started_tracker, "devices_under_key": len(emulated.running(args.key))}
    _emit(args, data, f"emulated Arm64 device under {args.key!r} ready in {server.started_s:.1f} s "
                      f"(pid {server.pid}, port {server.port}, log {server.log}); "
                      f"{data['devices_under_key']} device(s) under this key; stop with "
                      f"`tightfit device emulate --key {args.key} --stop`")
    return 0


def _conformance(args) -> int:
    from .conformance import per_op_table, run_node_tests, selected_cases, summarize

    try:
        names = selected_cases(args.cases, args.per_op)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    results = run_node_tests(args.engine, args.pattern, args.jobs, args.out, names=names)
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
    entry_point()
