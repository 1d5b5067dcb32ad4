"""Tuning sessions on a device over RPC: MetaSchedule, resumable, with faults reported, not hidden.

MetaSchedule's evolutionary search with the XGBoost cost model proposes kernels; each is built
here (cross-exported as a .so the device loads without a compiler) and timed on devices under one
tracker key by the RPC runner (one worker per device, so several devices share the work; every
session has an explicit timeout). Records go to a JSON database on disk as they are measured
(`tightfit compile --db DIR` applies them).

What MetaSchedule does not do, and this module adds:
- Resume without measuring anything twice: MetaSchedule's search does not look at the records
  already in the database (a TODO in its evolutionary search), so `SkipMeasured` wraps the search
  strategy and keeps candidates whose scheduled module is already recorded from being built or
  run; the search is told their recorded times instead. The trial budget is the session's total:
  a rerun measures only what is left of it.
- Faults: a candidate whose run fails is recorded as failed (not retried). A failure of the
  connection is checked against the tracker: if the device is gone, the session stops with
  DeviceLostError, the records of that batch measured before the loss are kept and the lost
  ones are not recorded (a rerun measures them).
MetaSchedule tunes static shapes: a model with symbolic dims is tuned at one shape bucket per
session (`tightfit tune --shape`), several sessions filling one database.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms
from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.builder.local_builder import _serialize_params
from tvm.s_tir.meta_schedule.builder.local_builder import _worker_func as _build_and_export
from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

from ..errors import DeviceError
from ..fresh_process import children_without_torch
from ..target import code_generation_target
from .tracker import TrackerAddress, devices_under, request

UPLOAD_SLACK_S = 30.0
WORKER_BUILDS = 256  # builds before the builder's worker is replaced (MetaSchedule's workers leak)
MAX_RUN_TIME_S = 1e10  # what MetaSchedule records for a candidate that failed
INFRASTRUCTURE_ERRORS = ("RPCRunner: An exception occurred", "Cannot request", "Connection", "connection",
                         "Broken pipe", "timed out", "Timeout")


class DeviceLostError(DeviceError):
    """The device under the session's key went away during tuning; the records so far are kept."""


@dataclass
class TuningSession:
    """Where and how to measure: a device key at a tracker, and how to link for it."""

    tracker: TrackerAddress
    key: str
    target: tvm.target.Target
    export_library: Callable[[tvm.runtime.Module, str], None]  # (module, path.so)
    session_timeout_s: float = 60.0
    build_timeout_s: float = 60.0


@dataclass
class TuningReport:
    database: str
    tasks: list[str]
    trials_requested: int
    recorded_before: int
    measured: int = 0
    failed: int = 0
    skipped_already_measured: int = 0
    issued: int = 0  # candidates handed to the builder: measured, failed, or still in flight
    best_ms: dict[str, float] = field(default_factory=dict)  # task -> best latency recorded
    seconds: float = 0.0
    devices: int = 0

    @property
    def trials_per_minute(self) -> float:
        return 60.0 * self.measured / self.seconds if self.seconds else 0.0


def recorded_trials(database_dir: str | Path) -> int:
    """Tuning records in the database (measured and failed ones)."""
    path = Path(database_dir) / "database_tuning_record.json"
    return sum(1 for line in path.read_text().splitlines() if line.strip()) if path.exists() else 0


def tune(mod: tvm.IRModule, session: TuningSession, database_dir: str | Path, trials: int,
         progress: Callable[[TuningReport, str], None] = lambda report, note: None,
         seed: int | None = None, trials_per_batch: int = 16) -> TuningReport:
    """Tune every kernel of `mod` (static shapes) until the database holds `trials` records;
    Records are committed after each batch of `trials_per_batch` candidates; `seed` fixes the
    search's random choices."""
    database_dir = Path(database_dir)
    database_dir.mkdir(parents=True, exist_ok=True)
    devices = devices_under(session.tracker, session.key)
    if devices == 0:
        raise DeviceError(f"the tracker at {session.tracker} has no device under key {session.key!r}; "
                          f"start one, e.g. `tightfit device emulate --key {session.key} "
                          f"--rpc-tracker {session.tracker}`")
    extracted = ms.relax_integration.extract_tasks(mod, session.target)
    report = TuningReport(str(database_dir), [task.task_name for task in extracted], trials,
                          recorded_trials(database_dir), devices=devices)
    remaining = trials - report.recorded_before
    if remaining <= 0 or not extracted:
        return report
    database = ms.database.JSONDatabase(work_dir=str(database_dir))
    # MetaSchedule's console log goes to stdout, which belongs to the caller's results: only its
    # warnings reach the console (on stderr); everything is in DIR/logs
    logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)
    import_tensor_intrinsics()
    with contextlib.redirect_stdout(sys.stderr):
        contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(
            extracted, str(database_dir / "logs"), strategy=SkipMeasured(database, report, remaining), num_threads=1,
            seed=seed)
    started = time.perf_counter()
    callback = RecordAndWatch(session, report, progress, started)
    # the build and run workers import TVM, and tvm_ffi imports torch where installed: 3-4 s
    # of each worker's start here, for nothing. The whole session runs inside: the pools
    # replace workers as it goes (after WORKER_BUILDS builds, a crash or a time-out).
    with children_without_torch():
        builder = SessionBuilder(session.build_timeout_s, _exporter(session.export_library))
        runner = ms.runner.RPCRunner(
            ms.runner.RPCConfig(session.tracker.host, session.tracker.port, session.key,
                                session_timeout_sec=int(session.session_timeout_s)),
            ms.runner.EvaluatorConfig(number=3, repeat=1, min_repeat_ms=0, enable_cpu_cache_flush=False),
            f_create_session=_create_session, max_workers=devices)
        # RPCRunner's workers have no time limit: a request for a key whose devices are gone
        # waits at the tracker forever. Each candidate gets the session timeout, plus time to
        # upload. The limit is set on the runner's own pool, whose worker its sanity check has
        # started (a new pool's worker took another 9 s to import TVM before the first
        # candidate ran).
        runner.pool._timeout = session.session_timeout_s + UPLOAD_SLACK_S
        try:
            with contextlib.redirect_stdout(sys.stderr):
                ms.tune.tune_tasks(
                    tasks=contexts, task_weights=weights, work_dir=str(database_dir / "logs"),
                    max_trials_global=remaining, num_trials_per_iter=min(trials_per_batch, remaining),
                    builder=builder, runner=runner, database=database,
                    # the XGBoost model trains after a few records, not after MetaSchedule's default 100
                    cost_model=ms.cost_model.XGBModel(num_warmup_samples=min(8, remaining)),
                    measure_callbacks=[callback, ms.measure_callback.RemoveBuildArtifact(),
                                       ms.measure_callback.UpdateCostModel()],
                    task_scheduler="round-robin")
        except Exception as err:  # a DeviceLostError raised by the callback arrives wrapped by TVM's FFI
            if callback.lost is not None:
                raise callback.lost from None
            raise DeviceError(f"tuning stopped: {str(err).strip().splitlines()[-1]}; the records measured so far "
                              f"are in {database_dir}, run the same command again to go on") from err
        finally:
            report.seconds = time.perf_counter() - started
            builder.shutdown()
    return report


def import_tensor_intrinsics() -> None:
    """Import TVM's tensor intrinsics (every MetaSchedule TuneContext does) in 5 s, not 35 s.

    Each of their ~250 TVMScript functions calls `inspect.stack()` while parsed; for every frame
    of the import machinery (`<frozen importlib._bootstrap>`) `inspect.getmodule` finds no file
    and walks all of `sys.modules` (2,000 modules with TVM loaded) again, ~18,000 times in all.
    Naming those frames' modules in inspect's file cache lets it answer from the cache.
    """
    file_cache = getattr(inspect, "modulesbyfile", None)  # CPython's, not a documented API
    if file_cache is not None:
        for frozen in ("importlib._bootstrap", "importlib._bootstrap_external"):
            file_cache[inspect.getabsfile(inspect, f"<frozen {frozen}>")] = frozen
    import tvm.s_tir.tensor_intrin  # noqa: F401


def _create_session(rpc_config: ms.runner.RPCConfig):
    """An RPC session for one candidate, failing at once when the key has no device left."""
    tracker = TrackerAddress(rpc_config.tracker_host, int(rpc_config.tracker_port))
    return request(tracker, rpc_config.tracker_key, rpc_config.session_timeout_sec)


def build_candidate(mod: tvm.IRModule, target: tvm.target.Target, _params) -> tvm.runtime.Module:
    # MetaSchedule's default build imports every tensor intrinsic first (~10 s per worker, mostly
    # for GPUs); fp32 CPU kernels need none of them.
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    # the candidate is timed as the compile will build it
    return tvm.compile(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod),
                       target=code_generation_target(target))


@derived_object
class SessionBuilder(ms.builder.PyBuilder):
    """Builds and exports candidates as MetaSchedule's LocalBuilder does, in one worker process
    kept for the session (replaced after WORKER_BUILDS builds, after a crash, or when a build
    overruns `timeout_s`). LocalBuilder starts a fresh worker for every batch, against a memory
    leak of long-lived workers; the start (importing TVM and tightfit) took 8.6 s of the 8.7 s
    that a batch of 2 candidates for the emulated Arm64 device took to build here."""

    def __init__(self, timeout_s: float, export: Callable[[tvm.runtime.Module], str]):
        super().__init__()
        self.timeout_s = timeout_s
        self.export = export
        self.pool = PopenPoolExecutor(max_workers=1, timeout=timeout_s, maximum_process_uses=WORKER_BUILDS)
        # the worker imports TVM while the search proposes the first batch
        self.pool.submit(_worker_ready)

    def build(self, build_inputs: list[ms.builder.BuilderInput]) -> list[ms.builder.BuilderResult]:
        jobs = [(build_candidate, self.export, build.mod, build.target, _serialize_params(build.params))
                for build in build_inputs]
        results = []
        for outcome in self.pool.map_with_error_catching(lambda job: _build_and_export(*job), jobs):
            if outcome.status == StatusKind.COMPLETE:
                results.append(ms.builder.BuilderResult(outcome.value, None))
            elif outcome.status == StatusKind.TIMEOUT:
                results.append(ms.builder.BuilderResult(None, f"build timed out after {self.timeout_s} s"))
            else:
                results.append(ms.builder.BuilderResult(None, f"build failed: {outcome.value}"))
        return results

    def shutdown(self) -> None:
        self.pool.shutdown()


def _worker_ready() -> bool:
    return True  # unpickling this function in the worker imports this module, and TVM with it


def _exporter(export_library):
    def export(module: tvm.runtime.Module) -> str:
        path = str(Path(tempfile.mkdtemp(prefix="tightfit-tune-")) / "kernel.so")
        export_library(module, path)
        return path
    return export


def _scheduled_hash(mod: tvm.IRModule) -> int:
    return tvm_ffi.structural_hash(mod)


# MetaSchedule's evolutionary search keeps a population of 512 candidates, sized for sessions of
# thousands of trials; every generation costs as much to mutate and predict whatever the session
# will measure (the first batch of a 4-trial session searched for 15 s on one core here, 2 s with
# a population of 64)
CANDIDATES_PER_TRIAL = 8
MAX_POPULATION = 512
MIN_POPULATION = 64  # the search starts from at least 50 unmeasured random candidates


def search_population(trials: int) -> int:
    """The evolutionary search's population for a session that may measure `trials` more
    candidates: CANDIDATES_PER_TRIAL for each, within MIN_POPULATION and MAX_POPULATION
    (MetaSchedule's own); a session of 64 trials or more searches as MetaSchedule does."""
    return max(MIN_POPULATION, min(MAX_POPULATION, CANDIDATES_PER_TRIAL * trials))


@derived_object
class SkipMeasured(ms.search_strategy.PySearchStrategy):
    """MetaSchedule's evolutionary search, minus the candidates the database already holds, and
    never more candidates than the session's `budget`, counted over every task's strategy as they
    are handed out (MetaSchedule checks its own limit per batch, and one task's batch may still be
    on the device, unrecorded, when the next task asks for candidates)."""

    def __init__(self, database: ms.database.Database, report: TuningReport, budget: int):
        self.database = database
        self.report = report
        self.budget = budget
        self.inner = ms.search_strategy.EvolutionarySearch(population_size=search_population(budget))
        self.recorded: dict[int, list[float]] = {}  # scheduled module hash -> recorded run seconds

    def _initialize_with_tune_context(self, context) -> None:
        self.context = context
        self.inner._initialize_with_tune_context(context)

    def pre_tuning(self, max_trials, num_trials_per_iter, design_spaces, database=None, cost_model=None):
        self.recorded = {}
        for record in self.database.get_all_tuning_records():  # failed ones too: never run them again
            if not tvm_ffi.structural_equal(record.workload.mod, self.context.mod):
                continue
            schedule = tvm.s_tir.Schedule(self.context.mod)
            record.trace.apply_to_schedule(schedule, remove_postproc=False)
            self.recorded[_scheduled_hash(schedule.mod)] = [float(s) for s in record.run_secs]
        # the inner search counts the skipped candidates too: give it room for them
        self.inner.pre_tuning(max_trials + len(self.recorded), num_trials_per_iter, design_spaces,
                              database, cost_model)

    def post_tuning(self) -> None:
        self.inner.post_tuning()

    def generate_measure_candidates(self):
        while True:
            budget_left = self.budget - self.report.issued
            if budget_left <= 0:
                return None
            candidates = self.inner.generate_measure_candidates()
            if candidates is None:
                return None
            fresh, known = [], []
            for candidate in candidates:
                (known if _scheduled_hash(candidate.sch.mod) in self.recorded else fresh).append(candidate)
            if known:
                self.report.skipped_already_measured += len(known)
                self.inner.notify_runner_results(known, [
                    ms.runner.RunnerResult(self.recorded[_scheduled_hash(c.sch.mod)], None) for c in known])
            if fresh:
                fresh = fresh[:budget_left]
                self.report.issued += len(fresh)
                return fresh

    def notify_runner_results(self, measure_candidates, results) -> None:
        self.inner.notify_runner_results(measure_candidates, results)

    def clone(self):
        return SkipMeasured(self.database, self.report, self.budget)


@derived_object
class RecordAndWatch(ms.measure_callback.PyMeasureCallback):
    """Commits each measured candidate (failed ones as failed), reports progress, and stops the
    session when the device is gone — without recording what the loss kept from being measured."""

    def __init__(self, session: TuningSession, report: TuningReport, progress, started: float):
        self.session = session
        self.report = report
        self.progress = progress
        self.started = started
        self.lost: DeviceLostError | None = None

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results) -> None:
        context = task_scheduler.tasks_[task_id].ctx
        lost_connection = [(candidate, result) for candidate, built, result
                           in zip(measure_candidates, builder_results, runner_results)
                           if built.error_msg is None and result.error_msg is not None
                           and _is_infrastructure(result.error_msg)]
        for candidate, result in zip(measure_candidates, runner_results):
            if not any(candidate.same_as(lost) for lost, _ in lost_connection):
                self._commit(task_scheduler.database_, context, candidate, result)
        self.report.seconds = time.perf_counter() - self.started
        if lost_connection:
            if devices_under(self.session.tracker, self.session.key) == 0:
                self.lost = DeviceLostError(
                    f"the device under {self.session.key!r} is gone (tracker {self.session.tracker} lists none); "
                    f"{self.report.measured} trials were measured and kept in {self.report.database}; "
                    f"bring the device back and run the same command again to resume")
                raise self.lost
            # the device is still there: these candidates crashed or hung it; never run them again
            for candidate, result in lost_connection:
                self._commit(task_scheduler.database_, context, candidate, result)
            first_error = lost_connection[0][1].error_msg.strip().splitlines()
            self.progress(self.report, f"{len(lost_connection)} candidate(s) lost their session (crashed or "
                                       f"hung the device?): {first_error[-1] if first_error else ''}")
        self.progress(self.report, context.task_name)

    def _commit(self, database, context, candidate, result) -> None:
        failed = result.error_msg is not None
        run_secs = [MAX_RUN_TIME_S] if failed else [float(s) for s in result.run_secs]
        database.commit_tuning_record(ms.database.TuningRecord(
            candidate.sch.trace, database.commit_workload(context.mod), run_secs, context.target,
            ms.arg_info.ArgInfo.from_prim_func(context.mod["main"])))
        if failed:
            self.report.failed += 1
            return
        self.report.measured += 1
        latency_ms = 1e3 * sum(run_secs) / len(run_secs)
        name = context.task_name
        self.report.best_ms[name] = min(latency_ms, self.report.best_ms.get(name, latency_ms))


def _is_infrastructure(error: str) -> bool:
    return any(marker in error for marker in INFRASTRUCTURE_ERRORS)
