"""A short search over each kernel's knobs, measured on the target, kept in the knob database.

MNN's semi-automatic search (MNN §3.2: hand-written kernels whose few parameters are chosen by
measuring on the device, between fixed kernels and full auto-tuning). For one model at given
input shapes:
1. Every kernel of the compiled model with tile knobs (register-tile kernels and width-vectors
   convs, `_kernels`) is found with its database bucket (knob_database.bucket_key: kind, column
   vectors, row-extent bucket).
2. Candidates per bucket (`candidate_knobs`), after the knobs the kernel has now (the defaults
   or an earlier record): each register tile (rows, vectors) that
   `isa.fits_registers` allows, from half the tallest tile up, each with the innermost
   reduction unrolled by 1 or UNROLL where the kernel has that knob; at most
   `max_candidates`, tallest tiles first (the defaults' choice) so that a cut keeps the likely
   winners.
3. Round k compiles the model with every bucket's k-th candidate in a scratch database (one
   pipeline run serves all buckets), builds each kernel's PrimFunc alone and times it at the
   given shapes on the target (TVM's time_evaluator: median of REPEAT runs of NUMBER calls).
4. The fastest candidate of each bucket is timed again against the knobs in use now, the two
   taking turns (`interleaved_medians`), and recorded with its time and shape unless the
   knobs in use now timed within MEASURED_MARGIN of it (then those are); so is the measured
   parallel threshold (`calibrate_min_parallel_work`). Compiles read the records;
   nothing is measured during a compile. MetaSchedule records, where present, still win.
The database is a cache: buckets that hold a record, and a recorded parallel threshold, are not
searched again (unless `remeasure`). The buckets searched in one run take turns round by round,
so their records are written together at the end: a search cut off there times them again.
The kernels are compiled for the target and timed on this machine, or on a device over RPC
(`remote`: an open connection, which loads each kernel's library cross-linked for it). The
driver (`search`) runs tightfit's importer and pipeline, imported when called: they sit above
schedules/ (DESIGN.md "Layout"); the kernel-level pieces below them do not need them.
Run: `tightfit search MODEL.onnx --shapes x=1,3,32,32 --knobs knobs.json --tiles 24` (with the
conv algorithms, algorithm_search.py), or python -m tightfit.schedules.knob_search MODEL.onnx
--db knobs.json --shapes x=1,3,32,32
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tvm
from tvm import s_tir, te, tirx

from ..errors import InputError
from .conv2d import (
    CHANNEL_ROWS_ANNOTATION,
    CHANNEL_VECTORS_ANNOTATION,
    FLAT_PIXELS_ANNOTATION,
    GROUPS_ANNOTATION,
    WIDTH_VECTORS,
    tile_kind,
)
from .conv_cost import MEASURED_MARGIN
from .isa import isa_for_target
from .knob_database import KnobDatabase, bucket_key
from .register_tile import (
    KERNEL_ANNOTATION,
    MAX_ROWS,
    REDUCTION_UNROLL_ANNOTATION,
    ROWS_ANNOTATION,
    SYMBOLIC_COLUMNS,
    VECTORS_ANNOTATION,
    TileKnobs,
    tile_cost,
)
from .schedule_kernels import REGISTER_TILE_KERNELS, ROW_EXTENT_ATTR
from .tail_tiles import rewrite_loop_nest

UNROLL = 4
NUMBER = 20
REPEAT = 5
DEFAULT_MAX_CANDIDATES = 24
CONFIRMATION_ROUNDS = 5  # the best tile against the one in use now, at the end


def search(model, database_path: str | Path, shapes: dict[str, tuple[int, ...]],
           max_candidates: int = DEFAULT_MAX_CANDIDATES, target="host", remote=None,
           progress: Callable[[str], None] = lambda note: None,
           remeasure: bool = False) -> dict[str, dict]:
    """Search every kernel bucket of `model` (ONNX path or proto) at `shapes` for `target`,
    timed on this machine or, with `remote` (a connection from `device_rpc.remote.connect`),
    on that device, and record the winners in `database_path`; returns {bucket: {"knobs",
    "us", "tried", "measured_before"}}, where a bucket the database already held (not searched
    again unless `remeasure`) was tried 0 times. `progress` hears each round as it starts."""
    from ..frontend import import_onnx
    from ..target import resolve_target

    target = resolve_target(target)
    imported = import_onnx(model)
    isa = isa_for_target(target.tvm_target)
    database = KnobDatabase.open(database_path, target.tvm_target)
    extents = symbol_values(imported.mod, shapes)
    compiled_with: dict[str, TileKnobs] = {}  # bucket -> the knobs its first kernel has now
    for bucket, func in _kernels(_schedule(imported.mod, target, database_path), isa):
        compiled_with.setdefault(bucket, _knobs_of(func))
    results = {}
    for bucket, knobs in compiled_with.items():
        record = None if remeasure else database.bucket_record(bucket)
        if record is not None:
            results[bucket] = {"knobs": knobs, "us": record["us"], "tried": 0, "measured_before": True}
    # the knobs a compile uses now (the defaults, or an earlier record) are always measured
    candidates = {bucket: list(dict.fromkeys([knobs, *candidate_knobs(bucket, isa)]))[:max_candidates]
                  for bucket, knobs in compiled_with.items() if bucket not in results}
    # bucket -> [(seconds, knobs, a timer per kernel of the bucket: kept for the knobs in use
    # now and the fastest so far, which are timed again at the end; None for the others, whose
    # libraries a device need not keep loaded)]
    timings: dict[str, list[tuple[float, TileKnobs, list | None]]] = {bucket: [] for bucket in candidates}
    scratch = Path(database_path).with_suffix(".search.json")
    try:
        rounds = max((len(c) for c in candidates.values()), default=0)
        for round_index in range(rounds):
            progress(f"tiles: round {round_index + 1} of {rounds}")
            trial = KnobDatabase(scratch, database.target_key, json.loads(json.dumps(database.data)))
            tried = {}
            for bucket, knobs_list in candidates.items():
                if round_index < len(knobs_list):
                    tried[bucket] = knobs_list[round_index]
                    trial.record_bucket(bucket, tried[bucket], 0.0, "candidate")
            trial.save()
            scheduled = _schedule(imported.mod, target, str(scratch))
            timers: dict[str, list] = {}
            for bucket, func in _kernels(scheduled, isa):
                if bucket in tried:
                    timers.setdefault(bucket, []).append(prim_func_timer(func, extents, target, remote))
            for bucket, bucket_timers in timers.items():
                timings[bucket].append((sum(timer() for timer in bucket_timers), tried[bucket],
                                        bucket_timers))
                fastest = min(timings[bucket], key=lambda entry: entry[0])
                timings[bucket] = [entry if entry is fastest or entry[1] == compiled_with[bucket]
                                   else (*entry[:2], None) for entry in timings[bucket]]
    finally:
        scratch.unlink(missing_ok=True)
    shape_text = ";".join(f"{name}={'x'.join(map(str, dims))}" for name, dims in shapes.items())
    for bucket, measured in timings.items():
        best_seconds, best, best_timers = min(measured, key=lambda entry: entry[0])
        current = next((entry for entry in measured if entry[1] == compiled_with[bucket]), None)
        if current is not None and best != current[1]:
            best_seconds, current_seconds = interleaved_medians(
                [lambda timers=timers: sum(timer() for timer in timers) for timers in (best_timers, current[2])],
                CONFIRMATION_ROUNDS)
            # as for conv algorithms (conv_cost.MEASURED_MARGIN): near-ties are noise, and the
            # knobs in use now stay unless another tile is clearly faster
            if current_seconds <= best_seconds * (1 + MEASURED_MARGIN):
                best_seconds, best = current_seconds, current[1]
        database.record_bucket(bucket, best, best_seconds * 1e6, shape_text)
        results[bucket] = {"knobs": best, "us": round(best_seconds * 1e6, 3), "tried": len(measured),
                           "measured_before": False}
    if remeasure or not database.has_min_parallel_work():
        progress("parallel threshold")
        database.record_min_parallel_work(calibrate_min_parallel_work(target, remote))
    database.save()
    return {bucket: results[bucket] for bucket in compiled_with}


def candidate_knobs(bucket: str, isa) -> list[TileKnobs]:
    """Register tiles for `bucket` (kind/v<column vectors>/m<rows>, or a width-vectors conv's
    kind/c<output channels>/m<rows>; knob_database.bucket_key), tallest first.

    A width-vectors conv's tile is channel rows (at most its output channels) x one or two
    vectors of output pixels (conv2d.width_tile_knobs), and it has no unroll knob; its tiles
    come in the order of their issue slots over the channels, padding included
    (register_tile.tile_cost, as the defaults weigh them): a 16-channel conv's 8-row tiles come
    before its 15-row ones. The other kernels' tiles are rows x up to four vectors of columns,
    no wider than the columns need, with the innermost reduction unrolled by 1 or UNROLL."""
    kind, column_part, _ = bucket.split("/")
    count = int(column_part[1:])
    width_vectors = kind.startswith(WIDTH_VECTORS)
    if width_vectors:
        vector_counts, max_rows, unrolls = (1, 2), min(MAX_ROWS, count), (1,)
    else:
        vector_counts = [v for v in (1, 2, 4) if v <= max(1, count)]
        max_rows, unrolls = MAX_ROWS, (1, UNROLL)
    tiles = []
    for vectors in vector_counts:
        fitting = [r for r in range(1, max_rows + 1) if isa.fits_registers(r, vectors)]
        if fitting:
            tallest = max(fitting)
            tiles += [(rows, vectors) for rows in range(max(1, tallest // 2), tallest + 1)]
    tiles.sort(key=lambda tile: (-tile[0] * tile[1], -tile[0]))
    if width_vectors:
        tiles.sort(key=lambda tile: -(-count // tile[0]) * tile_cost(*tile) / tile[1])
    return [TileKnobs(rows, vectors, unroll) for rows, vectors in tiles for unroll in unrolls]


def interleaved_medians(measures: list[Callable[[], float]], rounds: int) -> list[float]:
    """The median over `rounds` of each measurement (seconds), the measurements taking turns so
    that this machine's drift hits all alike: the search's rounds run minutes apart, and the
    drift between them was as large as the differences between a bucket's best tiles (and,
    timed one after another, a 3x3 conv's two fastest algorithms swapped places)."""
    samples = [[] for _ in measures]
    for _ in range(rounds):
        for measure, values in zip(measures, samples):
            values.append(measure())
    return [statistics.median(values) for values in samples]


def prim_func_timer(func: tirx.PrimFunc, extents: dict[str, int], target, remote=None):
    """A function that times one call of `func` (the median over TVM's time_evaluator), its
    symbolic dims bound by name to `extents`, on random inputs (the kernel's speed does not
    depend on the values), on this machine or on the device behind `remote`; compiled once."""
    module = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    library, device = _on_device(tvm.compile(module, target=target.code_generation()), target, remote)
    analyzer = tvm.sym.Analyzer()
    for param in func.params:
        for dim in getattr(param, "shape", []):
            for var in tirx.analysis.undefined_vars(dim):
                if var.name not in extents:
                    raise ValueError(f"no value for the symbolic dim {var.name}: give every "
                                     "symbolic input dim a value in the shapes")
                analyzer.bind(var, tirx.const(extents[var.name], str(var.ty.dtype)))
    rng = np.random.default_rng(0)
    arguments = []
    for param in func.params:
        if not hasattr(param, "shape"):
            arguments.append(extents[param.name])
            continue
        shape = [int(analyzer.simplify(dim)) for dim in param.shape]
        arguments.append(tvm.runtime.tensor(np.asarray(rng.random(shape)).astype(param.dtype), device))
    timer = library.time_evaluator("main", device, number=NUMBER, repeat=REPEAT)
    return lambda: statistics.median(timer(*arguments).results)


def _on_device(built, target, remote):
    """(module, device) to time `built` (tvm.compile's result for `target`) on: this machine,
    or the device behind `remote`."""
    if remote is None:
        return built.mod, tvm.cpu()
    return remote.load_built(built, target.cross_compiler, target.name), remote.device


def calibrate_min_parallel_work(target, remote=None) -> int:
    """Loop work at which a parallel loop starts to pay (dispatch.py), measured on a chain of two
    vectorized elementwise loops, as a model's kernels follow each other.

    Where the parallel chain overtakes the serial one depends on where the data is: when the
    second loop splits its rows as the first did, each core reads what it wrote; when it splits
    them the other way round, each reads what the other core wrote, and on this host the
    crossover moves from 2^16 to 2^19 iterations. A model's kernels do both (a conv split by
    images, then by pixels, then a depthwise conv split by channels), so the threshold is the
    geometric mean of the two crossovers, rounded down to a power of two: an elementwise
    iteration is the cheapest a loop has, and the window and depthwise loops, whose iterations
    cost more, gain more from a thread. 2^17 on this host, where timing whole zoo models at
    thresholds from 2^16 to 2^21 found the same value (dispatch.DEFAULT_MIN_PARALLEL_WORK).
    """
    crossovers = []
    for rows_reversed in (False, True):
        works = [1 << exponent for exponent in range(12, 23)]
        crossovers.append(next(
            (work for work in works
             if _elementwise_chain_seconds(target, work, True, rows_reversed, remote)
             < _elementwise_chain_seconds(target, work, False, rows_reversed, remote)),
            works[-1]))
    return 1 << math.floor(statistics.mean(math.log2(work) for work in crossovers))


CHAIN_COLUMNS = 64


def _elementwise_chain_seconds(target, work: int, parallel: bool, rows_reversed: bool,
                               remote=None) -> float:
    """Seconds of one call of b = 2a + 1, c = b'/2 - 1 over (rows, 64) floats, where the loop
    work 2 x rows x 64 is `work` and b' is b, or b with its rows reversed. The rows are static,
    as in a compiled kernel: over a symbolic row count the parallel chain ran 1.5-2x slower."""
    shape = (max(1, work // (2 * CHAIN_COLUMNS)), CHAIN_COLUMNS)
    a = te.placeholder(shape, name="a")
    b = te.compute(shape, lambda i, j: a[i, j] * 2.0 + 1.0, name="b")
    c = te.compute(shape, lambda i, j: b[shape[0] - 1 - i if rows_reversed else i, j] * 0.5 - 1.0,
                   name="c")
    sch = tvm.s_tir.Schedule(te.create_prim_func([a, c]))
    for block in ("b", "c"):
        row, column = sch.get_loops(sch.get_sblock(block))
        _, lane = sch.split(column, [None, isa_for_target(target.tvm_target).lanes])
        sch.vectorize(lane)
        if parallel:
            sch.parallel(row)
    library, device = _on_device(
        tvm.compile(tvm.IRModule({"main": sch.mod["main"]}), target=target.code_generation()), target, remote)
    arrays = [tvm.runtime.tensor(np.zeros(shape, "float32"), device) for _ in range(2)]
    timer = library.time_evaluator("main", device, number=NUMBER, repeat=REPEAT)
    return statistics.median(timer(*arrays).results)


def _schedule(mod: tvm.IRModule, target, database_path: str | None) -> tvm.IRModule:
    from ..pipeline import PipelineOptions, run_pipeline

    scheduled, _ = run_pipeline(mod, target, PipelineOptions(knob_database=database_path),
                                stop_after="tightfit.FallbackCPUSchedule")
    return scheduled


def _kernels(mod: tvm.IRModule, isa) -> list[tuple[str, tirx.PrimFunc]]:
    """(bucket, PrimFunc) of each kernel with tile knobs in a scheduled module: register-tile
    kernels and width-vectors convs, but not grouped ones (their channel rows must divide a
    group's channels, which a bucket does not know) or CHANNEL_VECTORS ones (fixed tiles)."""
    found = []
    for global_var, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        annotations = _kernel_annotations(func)
        if annotations is None or not _has_tile_knobs(annotations):
            continue
        kind = str(annotations[KERNEL_ANNOTATION])
        if kind == WIDTH_VECTORS:
            kind = tile_kind(FLAT_PIXELS_ANNOTATION in annotations)
        found.append((bucket_key(kind, _static_columns(func), func.attrs[ROW_EXTENT_ATTR], isa),
                      func.with_attr("global_symbol", global_var.name_hint)))
    return found


def _knobs_of(func: tirx.PrimFunc) -> TileKnobs:
    """The tile knobs a scheduled kernel was built with (a width-vectors conv's rows are its
    channel rows)."""
    annotations = _kernel_annotations(func)
    rows_annotation = (CHANNEL_ROWS_ANNOTATION if str(annotations[KERNEL_ANNOTATION]) == WIDTH_VECTORS
                       else ROWS_ANNOTATION)
    return TileKnobs(int(annotations[rows_annotation]), int(annotations[VECTORS_ANNOTATION]),
                     int(annotations.get(REDUCTION_UNROLL_ANNOTATION, 1)))


def _static_columns(func: tirx.PrimFunc) -> int:
    """A kernel's output columns (a conv's output channels), SYMBOLIC_COLUMNS where symbolic:
    the count SelectGemmKernel tiles them for and looks their records up by."""
    kind = str(_kernel_annotations(func)[KERNEL_ANNOTATION])
    output = func.params[-1]
    columns = output.shape[1] if kind in ("conv2d_direct", WIDTH_VECTORS) else output.shape[-1]
    return int(columns) if isinstance(columns, tirx.IntImm) else SYMBOLIC_COLUMNS


def _has_tile_knobs(annotations: dict) -> bool:
    kind = str(annotations[KERNEL_ANNOTATION])
    if kind == WIDTH_VECTORS:
        return (int(annotations.get(GROUPS_ANNOTATION, 1)) == 1
                and not bool(annotations.get(CHANNEL_VECTORS_ANNOTATION, False)))
    return kind in REGISTER_TILE_KERNELS


def _kernel_annotations(func: tirx.PrimFunc) -> dict | None:
    """The annotations of a scheduled PrimFunc's kernel block (a plain walk: a function joined
    from versions repeats block iterators and cannot be opened as a Schedule again)."""
    found = []

    def note(realize):
        if KERNEL_ANNOTATION in realize.block.annotations:
            found.append(dict(realize.block.annotations))
        return realize

    if isinstance(func.body, s_tir.SBlockRealize):
        rewrite_loop_nest(func.body, note)
    return found[0] if found else None


def symbol_values(mod: tvm.IRModule, shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """Symbolic dim name -> value, read off main's inputs at `shapes`; InputError naming the
    inputs when `shapes` names another."""
    num_input = int((mod["main"].attrs or {}).get("num_input", len(mod["main"].params)))
    inputs = [param.name for param in mod["main"].params[:num_input]]
    unknown = sorted(set(shapes) - set(inputs))
    if unknown:
        raise InputError(f"the model has no input {', '.join(unknown)}; its inputs are {', '.join(inputs)}")
    values = {}
    for param in mod["main"].params:
        if param.name not in shapes:
            continue
        for dim, value in zip(param.ty.shape.values, shapes[param.name]):
            if isinstance(dim, tirx.Var):
                values[dim.name] = int(value)
    return values


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tightfit.schedules.knob_search",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("model", help="an ONNX file")
    parser.add_argument("--db", required=True, help="the knob database (JSON) to update")
    parser.add_argument("--shapes", required=True, metavar="SPEC",
                        help="input shapes to measure at, e.g. x=1,3,32,32;y=4,8")
    parser.add_argument("--max-candidates", type=int, default=DEFAULT_MAX_CANDIDATES)
    args = parser.parse_args(argv)
    shapes = {name: tuple(int(d) for d in dims.split(","))
              for name, dims in (item.split("=") for item in args.shapes.split(";"))}
    results = search(args.model, args.db, shapes, args.max_candidates)
    print(json.dumps({bucket: {**r, "knobs": vars(r["knobs"])} for bucket, r in results.items()},
                     indent=1))


if __name__ == "__main__":
    main()
