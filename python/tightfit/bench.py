"""Benchmark: tightfit against onnxruntime and TVM's default Relax build, in one process.

DESIGN.md "Measuring". For each model and each input shape: the first run at that shape (a shape
not seen before), then the median of `repeat` timed runs after warm-up, and their spread
(`quartile_spread`: whether the machine stayed quiet while they ran). The engines take turns in
ROUNDS rounds so that drift on the shared machine hits all alike; each turn starts with a pause,
because onnxruntime's idle threads spin for tens of milliseconds after a run and, interleaved run
by run, made TVM's thread pool 20x slower (measured: 23.7 ms instead of 1.2 ms on a small conv
net). After the pause every engine runs untimed for WARM_UP_PER_TURN_S (at least once): a CPU
left idle comes back slowly, and one run was not enough (measured on this VM, both engines alike:
after 0.1 s idle a 23 us model took 250 us, then 30-40 us for the next ten runs, and only after
about 1 ms of runs its steady 23 us; mobilenet_v2_style at 2x3x96x80, 0.193 ms steady, still
timed 0.222 ms after 10 ms of runs, and 0.194 ms after 50 or 200 ms). Before and after each
shape's timed runs a probe times TVM's pool starting a parallel loop (`pool_start_us`): the host
has slow stretches of minutes in which that takes 10x longer and every parallel kernel slows,
which no spread shows when the whole shape falls inside one. Engines:
- tightfit: `tightfit.compile` for the host;
- onnxruntime: an InferenceSession with default session options (what its users get);
- tvm-default: `from_onnx` + `tvm.compile(mod, target)` with TVM's default pipeline.
The thread counts are stated in the report: tightfit and TVM share TVM's pool (sized by
TVM_NUM_THREADS, which tightfit sets to the cores it may run on; the count is read back from the
pool); onnxruntime keeps its default options, whose intra-op pool has one thread per physical
core (setting the count explicitly also drops its thread affinity, so it is left alone). On a
machine whose cores are all ours the counts are equal. Peak memory is the peak
RSS of a fresh process that loads and runs the model once, minus that of a process that only
imports the same libraries. An engine that cannot import or run a model is reported as failed with
its reason, and the others are still measured.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx

from .feeds import max_abs_error, random_feeds
from .fresh_process import worker_command
from .frontend import TensorSpec, declared_inputs, load_onnx

ENGINES = ("tightfit", "onnxruntime", "tvm-default")
ROUNDS = 8
PAUSE_BETWEEN_ENGINES_S = 0.1
WARM_UP_PER_TURN_S = 0.05
# a spread (quartile_spread) from which a median mixes slow and fast periods of the machine
BUSY_SPREAD = 0.2
# TVM's pool starting a parallel loop (`pool_start_us`) from which a shape counts as timed in a
# slow stretch of the host: twice its usual time on this project's 2-vCPU VM (0.6-1.0 us; in
# stretches of minutes 1.5-7 us, and in two zoo runs every shape timed at 1.5 us or more had
# onnxruntime's times up too, conv_dynamic_hw's twice its usual)
SLOW_POOL_START_US = 1.2
# The fast-kernels issue's target against each other engine, as tightfit's time over its time:
# each model within 1.5x of onnxruntime, and 20x faster than TVM's default build.
TARGET_RATIOS = {"onnxruntime": 1.5, "tvm-default": 1 / 20}


@dataclass
class ShapeTiming:
    shapes: dict[str, list[int]]
    first_run_ms: dict[str, float] = field(default_factory=dict)
    median_ms: dict[str, float] = field(default_factory=dict)
    spread: dict[str, float] = field(default_factory=dict)  # quartile_spread of the timed runs
    max_abs_error: float | None = None
    pool_start_us: float | None = None  # the slower `pool_start_us` before and after the runs


@dataclass
class ModelBenchmark:
    model: str
    threads: int  # TVM's pool: tightfit and tvm-default
    repeat: int
    onnxruntime_threads: int = 0  # its default intra-op pool: one thread per physical core
    compile_seconds: dict[str, float] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    shapes: list[ShapeTiming] = field(default_factory=list)
    peak_rss_mb: dict[str, float] = field(default_factory=dict)

    def ratio(self, timing: ShapeTiming, other: str) -> float | None:
        ours, theirs = timing.median_ms.get("tightfit"), timing.median_ms.get(other)
        return None if ours is None or theirs is None else ours / theirs


def benchmark_model(
    model: str | Path | onnx.ModelProto,
    shape_sets: list[dict[str, tuple[int, ...]]],
    name: str | None = None,
    repeat: int = 20,
    warmup: int = 3,
    measure_memory: bool = True,
    feeds_for: Callable[[dict[str, tuple[int, ...]]], dict[str, np.ndarray]] | None = None,
) -> ModelBenchmark:
    """Measure one model at each of `shape_sets` (input name → concrete shape)."""
    proto = load_onnx(model)
    specs = declared_inputs(proto.graph)
    result = ModelBenchmark(name or proto.graph.name or "model", tvm_pool_threads(), repeat,
                            physical_cores())
    runners = _build_engines(proto, result)
    feeds_for = feeds_for or (lambda shapes: random_feeds(specs, shapes))
    for shapes in shape_sets:
        feeds = feeds_for(shapes)
        timing = ShapeTiming({k: list(v) for k, v in shapes.items()})
        outputs = {}
        for engine, run in list(runners.items()):
            time.sleep(PAUSE_BETWEEN_ENGINES_S)
            try:
                started = time.perf_counter()
                outputs[engine] = run(feeds)
                timing.first_run_ms[engine] = (time.perf_counter() - started) * 1e3
            except Exception as err:  # an engine failing at one shape is a result, not a crash
                result.failures[engine] = f"run at {timing.shapes}: {_error_summary(err)}"
                del runners[engine]
        if "tightfit" in outputs and "onnxruntime" in outputs:
            timing.max_abs_error = max_abs_error(outputs["tightfit"], outputs["onnxruntime"])
        for _ in range(warmup):
            for run in runners.values():
                run(feeds)
        samples: dict[str, list[float]] = {engine: [] for engine in runners}
        pool_start_before = pool_start_us()
        for turn in range(ROUNDS):
            runs_this_turn = repeat // ROUNDS + (turn < repeat % ROUNDS)
            for engine, run in runners.items():
                time.sleep(PAUSE_BETWEEN_ENGINES_S)
                run_for(run, feeds, WARM_UP_PER_TURN_S)
                for _ in range(runs_this_turn):
                    started = time.perf_counter()
                    run(feeds)
                    samples[engine].append((time.perf_counter() - started) * 1e3)
        timing.median_ms = {engine: statistics.median(values) for engine, values in samples.items()}
        timing.spread = {engine: quartile_spread(values) for engine, values in samples.items()}
        timing.pool_start_us = round(max(pool_start_before, pool_start_us()), 2)
        result.shapes.append(timing)
    if measure_memory and shape_sets:
        result.peak_rss_mb = _measure_peak_rss(proto, shape_sets[-1], result)
    return result


def quartile_spread(values: list[float]) -> float:
    """The interquartile range of timed runs over their median: how far the machine let an
    engine's runs wander. On a shared VM whose cores other tenants slow down at times (this
    project's, measured: the same model took 16 us for seconds on end, then 28-35 us), a
    spread near zero says the median is the engine's steady time, one of BUSY_SPREAD or more
    that it mixes slow and fast periods, and ratios from it carry that doubt."""
    if len(values) < 2:
        return 0.0
    first, _, third = statistics.quantiles(values, n=4)
    return (third - first) / statistics.median(values)


def run_for(run: Callable, feeds: dict[str, np.ndarray], seconds: float) -> None:
    """Run at least once, and again until `seconds` have passed."""
    deadline = time.perf_counter() + seconds
    run(feeds)
    while time.perf_counter() < deadline:
        run(feeds)


def pool_start_us() -> float:
    """Microseconds TVM's pool takes to run a parallel loop with next to no work, one iteration
    per thread (median of 5 x 200 calls): what any kernel pays for running in parallel. It moves
    with the host, not with the model: on this project's 2-vCPU VM it was 0.6 us most of the
    time and 7 us in stretches of minutes, during which parallel kernels ran 2-3x slower and
    serial ones did not (conv_dynamic_hw at 1x3x64x20: 24 us, in such a stretch 36-46 us;
    onnxruntime, whose pool waits on the same cores, slowed with it). The report states it per
    shape, so that a ratio from a slow stretch can be told apart from a slow kernel."""
    return statistics.median(_pool_start_timer()()) * 1e6


@functools.cache
def _pool_start_timer() -> Callable[[], list[float]]:
    """Seconds per call of the probe loop, 5 times 200 calls (built once per process)."""
    import tvm
    from tvm.script import tirx as T

    from .target import resolve_target

    threads = tvm_pool_threads()

    @T.prim_func
    def parallel_touch(values: T.Buffer((threads, 16), "float32")):
        for thread in T.parallel(threads):
            for lane in range(16):
                values[thread, lane] = values[thread, lane] + T.float32(1)

    library = tvm.compile(tvm.IRModule({"parallel_touch": parallel_touch}),
                          target=resolve_target("host").tvm_target).mod
    values = tvm.runtime.tensor(np.zeros((threads, 16), np.float32))
    timer = library.time_evaluator("parallel_touch", tvm.cpu(), number=200, repeat=5)
    return lambda: list(timer(values).results)


def tvm_pool_threads() -> int:
    """The threads of TVM's pool in this process (tightfit's import sizes it; see __init__)."""
    import tvm

    return int(tvm.get_global_func("runtime.NumThreads")())


def physical_cores() -> int:
    """What onnxruntime's default intra-op pool is sized to."""
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def _build_engines(proto: onnx.ModelProto, result: ModelBenchmark) -> dict[str, Callable]:
    builders = {"tightfit": _tightfit_runner, "onnxruntime": _onnxruntime_runner,
                "tvm-default": _tvm_default_runner}
    runners = {}
    for engine, build in builders.items():
        started = time.perf_counter()
        try:
            runners[engine] = build(proto)
        except Exception as err:  # report and go on with the other engines
            result.failures[engine] = f"build: {_error_summary(err)}"
            continue
        result.compile_seconds[engine] = round(time.perf_counter() - started, 3)
    return runners


def _tightfit_runner(proto: onnx.ModelProto) -> Callable:
    from .api import compile as tightfit_compile

    session = tightfit_compile(proto).session()
    return session.run


def _onnxruntime_runner(proto: onnx.ModelProto) -> Callable:
    import onnxruntime

    session = onnxruntime.InferenceSession(proto.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    names = [output.name for output in session.get_outputs()]
    return lambda feeds: dict(zip(names, session.run(names, feeds)))


def tvm_default_build(proto: onnx.ModelProto):
    """TVM's own path for an ONNX file: stock importer, default pipeline, host target."""
    import tvm
    from tvm.relax.frontend.onnx import from_onnx

    from .target import resolve_target

    mod = from_onnx(proto)
    return tvm.compile(mod, resolve_target("host").tvm_target)


def _tvm_default_runner(proto: onnx.ModelProto) -> Callable:
    return _vm_runner(tvm_default_build(proto), [o.name for o in proto.graph.output],
                      [s.name for s in declared_inputs(proto.graph)])


def _vm_runner(executable, output_names: list[str], input_names: list[str]) -> Callable:
    import tvm
    from tvm import relax

    from .session import _flatten

    vm = relax.VirtualMachine(executable, tvm.cpu())

    def run(feeds):
        arguments = [tvm.runtime.tensor(np.asarray(feeds[name], order="C")) for name in input_names]
        values = _flatten(vm["main"](*arguments))
        return {name: value.numpy() for name, value in zip(output_names, values)}

    return run


# --- measurements in fresh processes ------------------------------------------------------------

def _measure_peak_rss(proto: onnx.ModelProto, shapes: dict[str, tuple[int, ...]],
                      result: ModelBenchmark) -> dict[str, float]:
    peaks = {}
    with tempfile.TemporaryDirectory(prefix="tightfit-bench-") as scratch:
        model_path = Path(scratch) / "model.onnx"
        onnx.save(proto, str(model_path))
        artifacts = {"onnxruntime": str(model_path)}
        if "tightfit" not in result.failures:
            from .api import compile as tightfit_compile

            artifacts["tightfit"] = str(tightfit_compile(proto).save(Path(scratch) / "model.tfpkg"))
        if "tvm-default" not in result.failures:
            library = Path(scratch) / "tvm_default.so"
            tvm_default_build(proto).export_library(str(library))
            artifacts["tvm-default"] = str(library)
        baseline = run_worker({"job": "import-only"})["peak_rss_kib"]
        for engine, artifact in artifacts.items():
            job = {"job": f"run-{engine}", "artifact": artifact, "model": str(model_path),
                   **run_job_io(proto, shapes)}
            try:
                peaks[engine] = round((run_worker(job)["peak_rss_kib"] - baseline) / 1024, 1)
            except RuntimeError as err:
                result.failures.setdefault(engine, f"memory: {err}")
    return peaks


def run_job_io(proto: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> dict:
    """The part of a `run-*` job that describes the model's inputs, outputs and shapes."""
    return {"inputs": [spec.to_json() for spec in declared_inputs(proto.graph)],
            "outputs": [output.name for output in proto.graph.output],
            "shapes": {k: list(v) for k, v in shapes.items()}}


def run_worker(job: dict) -> dict:
    """Run `job` (see `_worker`) in a fresh interpreter; its seconds and peak RSS in KiB."""
    completed = subprocess.run(worker_command("tightfit.bench", json.dumps(job)),
                               capture_output=True, text=True, timeout=1800)
    if completed.returncode != 0:
        raise RuntimeError(_last_line(completed.stderr) or f"exit code {completed.returncode}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _worker(job: dict) -> None:
    """One measured job. Every job imports the same libraries first, so that subtracting the
    `import-only` job's peak leaves what the job itself cost; `seconds` times the job alone."""
    import onnxruntime  # noqa: F401
    import tvm

    from . import compile as tightfit_compile
    from . import load
    from .feeds import random_feeds

    kind = job["job"]
    started = time.perf_counter()
    if kind.startswith("run-"):
        # Input and output names come with the job: reading them from the ONNX file would load
        # its weights into this process and count them against the engine being measured.
        specs = [TensorSpec.from_json(spec) for spec in job["inputs"]]
        feeds = random_feeds(specs, {k: tuple(v) for k, v in job["shapes"].items()})
        if kind == "run-tightfit":
            load(job["artifact"]).session().run(feeds)
        elif kind == "run-onnxruntime":
            _onnxruntime_runner(onnx.load(job["model"]))(feeds)
        else:
            _vm_runner(tvm.runtime.load_module(job["artifact"]), job["outputs"],
                       [spec.name for spec in specs])(feeds)
    elif kind == "build-tightfit":  # compile from ONNX, write the package, open a session
        tightfit_compile(job["model"]).save(job["artifact"])
        load(job["artifact"]).session()
    elif kind == "load-tightfit":  # open a built package and a session
        load(job["artifact"]).session()
    elif kind == "build-tvm-default":  # TVM's way: weights bound as constants into the library
        tvm_default_build(onnx.load(job["model"])).export_library(job["artifact"])
        tvm.relax.VirtualMachine(tvm.runtime.load_module(job["artifact"]), tvm.cpu())
    elif kind == "load-tvm-default":
        tvm.relax.VirtualMachine(tvm.runtime.load_module(job["artifact"]), tvm.cpu())
    elif kind != "import-only":
        raise ValueError(f"unknown job {kind}")
    print(json.dumps({"seconds": time.perf_counter() - started, "peak_rss_kib": peak_rss_kib()}))


def peak_rss_kib() -> int:
    """This process's peak resident set (VmHWM). Not getrusage's ru_maxrss: that survives exec,
    so a child started from a large parent would report the parent's peak."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/status has no VmHWM line")


# --- reports -----------------------------------------------------------------------------------

def markdown_table(results: list[ModelBenchmark]) -> str:
    header = ("| model | shape | tightfit ms | onnxruntime ms | tvm-default ms | tightfit/ORT | "
              "tightfit/TVM | first run ms (tf / ORT / TVM) | spread (tf / ORT / TVM) | "
              "pool start us | max abs err |")
    lines = [header, "|" + "---|" * 11]
    for result in results:
        for timing in result.shapes:
            ms = timing.median_ms
            first = timing.first_run_ms
            lines.append("| " + " | ".join([
                result.model,
                _shape_text(timing.shapes),
                _fmt(ms.get("tightfit")), _fmt(ms.get("onnxruntime")), _fmt(ms.get("tvm-default")),
                _fmt(result.ratio(timing, "onnxruntime"), "x"),
                _fmt(result.ratio(timing, "tvm-default"), "x"),
                " / ".join(_fmt(first.get(engine)) for engine in ENGINES),
                " / ".join(_percent(timing.spread.get(engine)) for engine in ENGINES),
                _fmt(timing.pool_start_us),
                "-" if timing.max_abs_error is None else f"{timing.max_abs_error:.1e}",
            ]) + " |")
    lines += ["", *ratio_summary(results)]
    memory = [r for r in results if r.peak_rss_mb]
    if memory:
        lines += ["", "| model | peak RSS MB tightfit | onnxruntime | tvm-default |", "|---|---|---|---|"]
        lines += [f"| {r.model} | " + " | ".join(_fmt(r.peak_rss_mb.get(e)) for e in ENGINES) + " |"
                  for r in memory]
    failures = [(r.model, engine, why) for r in results for engine, why in r.failures.items()]
    if failures:
        lines += ["", "Failures:"] + [f"- {model} / {engine}: {why}" for model, engine, why in failures]
    tvm_threads = ", ".join(map(str, sorted({r.threads for r in results})))
    repeats = ", ".join(map(str, sorted({r.repeat for r in results})))
    ort_threads = ", ".join(map(str, sorted({r.onnxruntime_threads for r in results})))
    lines += ["", f"Threads: tightfit and tvm-default {tvm_threads} (TVM's pool), onnxruntime "
              f"{ort_threads} (its default: one per physical core); {os.cpu_count()} CPUs on this "
              f"machine. Median of {repeats} timed runs after warm-up, engines taking turns in {ROUNDS} rounds, "
              f"each turn a {PAUSE_BETWEEN_ENGINES_S * 1e3:g} ms pause and {WARM_UP_PER_TURN_S * 1e3:g} ms "
              "of untimed runs. Spread: the interquartile range of the timed runs over their "
              f"median; from {BUSY_SPREAD:.0%} the machine was busy in part of the run, and the "
              "median mixes slow and fast periods. Pool start: microseconds TVM's pool took to run "
              "a parallel loop with next to no work, the slower of a probe before and after the "
              f"shape's timed runs; from {SLOW_POOL_START_US:g} us the host was in a slow stretch, "
              "in which every engine's parallel kernels slow down and serial ones do not."]
    return "\n".join(lines)


def ratio_summary(results: list[ModelBenchmark]) -> list[str]:
    """A line per other engine: the geometric mean of tightfit's time over its time, on every
    shape both engines ran, and the model whose worst shape is slowest against it (how the
    fast-kernels issue states its targets: each model within 1.5x of onnxruntime, the geomean
    at or below it). It counts the shapes where either engine's spread reached BUSY_SPREAD, and
    those timed while TVM's pool was slow to start (SLOW_POOL_START_US): their ratios come from
    a machine that was busy or slow during part or all of the run."""
    lines = []
    for engine in ENGINES[1:]:
        ratios = [(ratio, result.model, timing) for result in results for timing in result.shapes
                  if (ratio := result.ratio(timing, engine)) is not None]
        if not ratios:
            continue
        geomean = math.exp(statistics.fmean(math.log(ratio) for ratio, _, _ in ratios))
        worst, model, timing = max(ratios, key=lambda entry: entry[0])
        shapes = _shape_text(timing.shapes)
        busy = sum(max(timing.spread.get("tightfit", 0.0), timing.spread.get(engine, 0.0))
                   >= BUSY_SPREAD for _, _, timing in ratios)
        slow_pool = sum((timing.pool_start_us or 0.0) >= SLOW_POOL_START_US
                        for _, _, timing in ratios)
        lines.append(f"tightfit/{engine}: geomean {geomean:.3g}x over {len(ratios)} shapes of "
                     f"{len({model for _, model, _ in ratios})} models; slowest against it: "
                     f"{model} at {shapes}, {worst:.3g}x; {busy} of the shapes timed with a "
                     f"spread of {BUSY_SPREAD:.0%} or more, {slow_pool} while TVM's pool took "
                     f"{SLOW_POOL_START_US:g} us or more to start a parallel loop.")
        lines.append(_target_summary(engine, ratios))
    return lines


def _target_summary(engine: str, ratios: list[tuple[float, str, ShapeTiming]]) -> str:
    """How many shapes meet the target against `engine` (TARGET_RATIOS), and for each that
    does not, tightfit's time and the time that would meet it."""
    target = TARGET_RATIOS[engine]
    short = [(model, timing) for ratio, model, timing in ratios if ratio > target]
    line = (f"tightfit/{engine} at or below {target:.3g}x (the target) on "
            f"{len(ratios) - len(short)} of {len(ratios)} shapes")
    if not short:
        return line + "."
    return line + "; short of it: " + ", ".join(
        f"{model} at {_shape_text(timing.shapes)} ({_fmt(timing.median_ms['tightfit'] * 1e3)} us "
        f"against the {_fmt(timing.median_ms[engine] * target * 1e3)} us that meets it)"
        for model, timing in short) + "."


def write_reports(results: list[ModelBenchmark], directory: str | Path) -> tuple[Path, Path]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    json_path = directory / "bench.json"
    json_path.write_text(json.dumps([asdict(r) for r in results], indent=2))
    markdown_path = directory / "bench.md"
    markdown_path.write_text(markdown_table(results) + "\n")
    return json_path, markdown_path


def _shape_text(shapes: dict[str, list[int]]) -> str:
    return "; ".join(f"{name}={'x'.join(map(str, dims))}" for name, dims in shapes.items())


def _fmt(value: float | None, suffix: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:.3g}{suffix}" if value < 100 else f"{value:.0f}{suffix}"


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction:.0%}"


def _error_summary(error: Exception) -> str:
    return _last_line(str(error)) or type(error).__name__


def _last_line(text: str) -> str:
    """TVM puts the message on the last line of its multi-line errors; its C++ log warnings
    (`[hh:mm:ss] file.cc:NN: Warning: ...`), printed as a process exits, are not the message."""
    lines = [line for line in text.strip().splitlines()
             if line.strip() and not re.match(r"\[\d\d:\d\d:\d\d\] .*Warning", line)]
    return lines[-1][:300] if lines else ""


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))
