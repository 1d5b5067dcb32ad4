"""Each conv's candidate algorithms timed on the target, for SelectConvAlgorithm to choose by.

MNN §3.1 ("pre-inference"): each conv's algorithm is chosen before the first run, by a cost
whose back-end terms are measured on the device. tightfit's cost model (schedules/conv_cost.py)
was fitted on one x86 host, so on another machine, a phone above all, its choice is a guess;
this search replaces the guess by measurement, for one model at the input shapes given:
1. The model is imported and run through the pipeline up to RDP, and every conv that
   SelectConvAlgorithm chooses for is found (`convs_to_choose`), with its input shape at those
   inputs (RDP's expressions evaluated) and its candidates (`ConvCosting`: the ones the pass
   weighs, with the model's estimates). Convs with one key (ConvShape.measurement_key) are
   timed once.
2. Each is cut out as a one-node ONNX model with random weights, its input dims symbolic where
   the model's are (a symbolic plane slows some kernels: the width kernel's 16 -> 16 3x3 at
   32x32 took 30 us against 16 us static), and compiled once per candidate
   (PipelineOptions.conv_algorithms), with the knob database's tiles.
3. Each package is timed whole on the target (Session.time_run: the VM's timer, on this machine
   or on a device over RPC), so a candidate's extra kernels and their launches count.
4. The times go to the knob database under the conv's key, saved after each conv; a candidate
   that fails to compile or run is recorded as failed and is never chosen. SelectConvAlgorithm
   then ranks the measured candidates by time (conv_cost.with_measurements), its workspace
   limit still applying.
The database is a cache: a conv key whose record already times every candidate is not timed
again (unless `remeasure`), so a search cut off midway, or run again for another model with
convs of the same keys, times only what is missing.
Limits: a conv whose input dims depend on values known only at run time (after NonZero) is not
timed and keeps the model's choice; a symbolic dim is timed at the given extent only; a conv is
timed alone, without its epilogue and with its input in cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax, tirx

from .errors import CompilationError
from .frontend import import_onnx
from .passes.select_conv_algorithm import ConvCosting, convs_to_choose
from .pipeline import PipelineOptions, run_pipeline
from .schedules.conv_cost import Candidate, ConvShape, candidate_costs, choose, with_measurements
from .schedules.knob_database import KnobDatabase
from .schedules.knob_search import interleaved_medians, symbol_values
from .target import resolve_target

# each candidate's time: the median of TIMING_ROUNDS turns of at least TIMING_MIN_REPEAT_MS each
TIMING_ROUNDS = 9
TIMING_MIN_REPEAT_MS = 10


@dataclass
class ConvTiming:
    """One conv key's candidates: the model's estimates and the times measured on the target."""

    key: str
    input_shape: tuple[int, ...]  # the concrete input it was timed at
    convs: int  # convs of the model that share the key
    estimated_us: dict[str, float]  # at the pass's typical extents
    estimated_choice: str  # the cost model's
    estimated_at_input_us: dict[str, float]  # at the input it was timed at
    measured_us: dict[str, float | None] = field(default_factory=dict)  # None: failed there
    measured_choice: str | None = None  # SelectConvAlgorithm's, given the times (no budget)
    errors: dict[str, str] = field(default_factory=dict)
    measured_before: bool = False  # the times are the database's, from an earlier search


def search_conv_algorithms(model, shapes: dict[str, tuple[int, ...]], database_path: str | Path,
                           target="host", remote=None,
                           progress: Callable[[str], None] = lambda note: None,
                           remeasure: bool = False) -> list[ConvTiming]:
    """Time the candidates of every conv of `model` (an ONNX path or proto) at `shapes` on
    `target`, on this machine or, with `remote` (a connection from `device_rpc.remote.connect`),
    on that device, and record them in the knob database at `database_path`. Convs the
    database already times are taken from it, unless `remeasure`. `progress` hears each
    candidate as it is compiled."""
    compile_target = resolve_target(target)
    imported = import_onnx(model)
    database = KnobDatabase.open(database_path, compile_target.tvm_target)
    mod, _ = run_pipeline(imported.mod, compile_target,
                          PipelineOptions(knob_database=str(database_path)),
                          stop_after="tightfit.RankDimensionPropagation")
    extents = symbol_values(mod, shapes)
    timings: dict[str, tuple[ConvTiming, list[Candidate], relax.Call]] = {}
    with compile_target.tvm_target:
        costing = ConvCosting(mod["main"], database)
        for call in convs_to_choose(mod["main"]):
            candidates = costing.estimates(call)
            input_shape = _concrete(call.args[0].ty.shape.values, extents)
            if input_shape is None or len(candidates) < 2:  # nothing to time, or nothing to choose
                continue
            key = costing.shape(call).measurement_key
            if key in timings:
                timings[key][0].convs += 1
                continue
            estimated = {c.name: round(c.seconds * 1e6, 3) for c in candidates}
            at_input = {c.name: round(c.seconds * 1e6, 3) for c in candidate_costs(
                ConvShape.from_call(call, {"default": 1, **extents}), costing.isa, costing.rates)
                if c.name in estimated}
            timings[key] = (ConvTiming(key, input_shape, 1, estimated, choose(candidates, None).name,
                                       at_input), candidates, call)
    for timing, candidates, call in timings.values():
        recorded = None if remeasure else database.conv_record(timing.key)
        if recorded is not None and set(timing.estimated_us) <= set(recorded["us"]):
            timing.measured_us = {name: recorded["us"][name] for name in timing.estimated_us}
            timing.input_shape = tuple(int(dim) for dim in recorded["shape"].split("x"))
            timing.measured_choice = choose(with_measurements(candidates, timing.measured_us), None).name
            timing.measured_before = True
            continue
        conv_model, feeds = cut_out_conv(call, timing.input_shape)
        sessions = {}
        for algorithm in timing.estimated_us:
            progress(f"{timing.key}: {algorithm}")
            try:
                sessions[algorithm] = _candidate_session(conv_model, algorithm, compile_target,
                                                         database_path, remote)
            except CompilationError as err:
                timing.errors[algorithm] = str(err)
        medians = interleaved_medians(
            [lambda session=session: session.time_run(feeds, repeat=1, min_repeat_ms=TIMING_MIN_REPEAT_MS)[0]
             for session in sessions.values()], TIMING_ROUNDS)
        seconds = dict(zip(sessions, medians))
        timing.measured_us = {name: seconds[name] * 1e6 if name in seconds else None
                              for name in timing.estimated_us}
        timing.measured_choice = choose(with_measurements(candidates, timing.measured_us), None).name
        database.record_conv_times(timing.key, timing.measured_us,
                                   "x".join(map(str, timing.input_shape)))
        if database.path is not None:
            database.save()  # after every conv: an interrupted search keeps what it measured
    return [timing for timing, _, _ in timings.values()]


def cut_out_conv(call: relax.Call, input_shape: tuple[int, ...]) -> tuple[onnx.ModelProto, dict]:
    """A one-node ONNX model of the conv2d or conv1d `call` with random weights, its input dims
    symbolic where the call's are, and random feeds of `input_shape`."""
    attrs = call.attrs

    def declared(dims, prefix: str) -> list[int | str]:
        return [int(d) if isinstance(d, tirx.IntImm) else f"{prefix}{axis}"
                for axis, d in enumerate(dims)]

    weight_shape = [int(d) for d in call.args[1].ty.shape.values]
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal(weight_shape) / np.sqrt(np.prod(weight_shape[1:]))).astype(np.float32)
    node = helper.make_node(
        "Conv", ["x", "w"], ["y"], kernel_shape=weight_shape[2:],
        strides=[int(s) for s in attrs.strides], dilations=[int(d) for d in attrs.dilation],
        pads=[int(p) for p in attrs.padding], group=int(attrs.groups))
    graph = helper.make_graph(
        [node], "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                       declared(call.args[0].ty.shape.values, "in"))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, declared(call.ty.shape.values, "out"))],
        [numpy_helper.from_array(weight, "w")])
    conv_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return conv_model, {"x": rng.standard_normal(input_shape).astype(np.float32)}


def _candidate_session(conv_model: onnx.ModelProto, algorithm: str, target, database_path, remote):
    """A session running `conv_model` compiled with `algorithm`, on this machine or the device."""
    from .api import compile as tightfit_compile

    package = tightfit_compile(conv_model, target, options=PipelineOptions(
        conv_algorithms=(algorithm,), knob_database=str(database_path)))
    return package.session_on(remote) if remote is not None else package.session()


def _concrete(dims, extents: dict[str, int]) -> tuple[int, ...] | None:
    """`dims` evaluated with the symbols at `extents`; None if one depends on anything else."""
    analyzer = tvm.sym.Analyzer()
    values = []
    for dim in dims:
        for var in tirx.analysis.undefined_vars(dim):
            if var.name not in extents:
                return None
            analyzer.bind(var, tirx.const(extents[var.name], var.ty.dtype))
        value = analyzer.simplify(dim)
        if not isinstance(value, tirx.IntImm):
            return None
        values.append(int(value.value))
    return tuple(values)


def timing_table(timings: list[ConvTiming]) -> str:
    """A Markdown table: each conv key's measured candidates and the two choices (the cost
    model's estimates, at the pass's typical extents, are in the JSON report)."""
    lines = ["| conv | timed at | convs | measured us | cost model's choice | measured choice |",
             "|---|---|---|---|---|---|"]
    for timing in timings:
        cells = ", ".join(f"{name} " + ("failed" if us is None else f"{us:.1f}")
                          for name, us in timing.measured_us.items())
        timed_at = "x".join(map(str, timing.input_shape)) + (" (earlier)" if timing.measured_before else "")
        lines.append(f"| {timing.key} | {timed_at} | {timing.convs} | "
                     f"{cells} | {timing.estimated_choice} | {timing.measured_choice or '-'} |")
    return "\n".join(lines)


def plot_timings(timings: list[ConvTiming], path: str | Path) -> Path:
    """Log-log: each candidate of each timed conv, the cost model's estimate at the timed input
    against the time measured on the target, one marker per algorithm; on the diagonal the
    model is right, and a candidate far off it is where its constants do not fit this device."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 6))
    markers = dict(zip(sorted({name for t in timings for name in t.measured_us}), "osD^v<>"))
    for name, marker in markers.items():
        points = [(t.estimated_at_input_us[name], t.measured_us[name]) for t in timings
                  if t.measured_us.get(name) is not None]
        axes.scatter([p[0] for p in points], [p[1] for p in points], marker=marker, label=name,
                     alpha=0.8)
    values = [v for t in timings for v in (*t.estimated_at_input_us.values(), *t.measured_us.values())
              if v]
    if values:
        axes.plot([min(values), max(values)], [min(values), max(values)], color="black",
                  linewidth=0.8, label="estimate = measured")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("cost model's estimate at the timed input (us)")
    axes.set_ylabel("measured on the target (us)")
    axes.set_title(f"Conv candidates: {len(timings)} conv shape(s)")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return Path(path)
