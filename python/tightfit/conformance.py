"""Conformance: the ONNX backend node tests (shipped in the `onnx` package) run through tightfit.

`TightfitBackend` is an `onnx.backend.base.Backend`, so onnx's own `BackendTest` can drive it;
`run_node_tests` runs the node cases itself so that each case is isolated and classified:
- pass: outputs equal onnx's reference (onnx's comparison and per-case tolerances);
- fail: wrong numbers, a conversion or compile error, a crash or a time-out;
- not-supported: an op tightfit does not import, inputs or outputs that are not tensors
  (sequences, optionals), or a failing case whose model uses an element type outside
  SUPPORTED_DTYPES (strings, complex numbers, 2/4/6/8-bit floats and integers).
Inputs are normalized as onnx's runner does: TensorProto values and numpy scalars become arrays.
A case counts under the op its test exercises: the op of its single node, or for an `_expanded`
case (the op's function body inlined) the op of the case it expands.
Cases run in worker processes, fed one case at a time; a worker that crashes (TVM can abort the
process) or takes longer than the time limit is replaced and the case counted as failed. The same
runner measures stock TVM 0.27 (`from_onnx` + `tvm.compile`, engine "tvm"), so the comparison is
made, not quoted.

    python -m tightfit.conformance [--engine tightfit|tvm] [--pattern REGEX] [--jobs N] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import selectors
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep

from .fresh_process import worker_command
from .user_cache import cache_dir, write_whole

PASS, FAIL, NOT_SUPPORTED = "pass", "fail", "not-supported"
CASE_TIMEOUT_S = 30  # a case still compiling after this counts as failed
# A worker's start (importing TVM, tightfit and onnx's cases) is not a case's time: on a loaded
# 2-core machine it took most of the first cases' 30 s, and they "timed out" in CI.
WORKER_START_TIMEOUT_S = 300
POLL_S = 0.05  # how often the runner looks at the clock while cases run (their time limits)
READY = "ready"
# Element types tightfit compiles for; others (float8, int4, strings...) are outside its scope.
SUPPORTED_DTYPES = frozenset(
    ["float16", "bfloat16", "float32", "float64", "bool", "int8", "int16", "int32", "int64",
     "uint8", "uint16", "uint32", "uint64"])


class TightfitRep(BackendRep):
    def __init__(self, package):
        self.session = package.session()

    def run(self, inputs, **kwargs):
        if isinstance(inputs, dict):
            feeds = inputs
        else:
            feeds = dict(zip(self.session.input_names, inputs))
        return tuple(self.session.run(feeds).values())


class TightfitBackend(Backend):
    """onnx's backend interface over `tightfit.compile` for the host CPU."""

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs) -> TightfitRep:
        from . import compile as tightfit_compile

        return TightfitRep(tightfit_compile(model))

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device == "CPU"


@dataclass
class CaseResult:
    name: str
    op: str
    status: str
    reason: str = ""
    seconds: float = 0.0


@cache
def node_cases() -> dict:
    """The node test cases of the installed onnx, by name.

    onnx generates them when they are loaded (its reference implementation computes every
    expected output): 10 s of CPU in each process, and a conformance run starts several (its
    workers, pytest's). The first process keeps them in a file of the user cache, named by onnx's
    version, which the others read in 0.05 s."""
    import pickle
    import warnings

    from onnx.backend.test.loader import load_model_tests

    path = cache_dir() / f"onnx-{onnx.__version__}-node-cases.pickle"
    try:
        with open(path, "rb") as cached:
            return pickle.load(cached)
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
        pass  # none yet, or written by another onnx: generate them
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the case generators overflow casts on purpose
        cases = {case.name: case for case in load_model_tests(kind="node")}
    write_whole(path, lambda file: pickle.dump(cases, file, protocol=pickle.HIGHEST_PROTOCOL))
    return cases


def case_op(name: str) -> str:
    """The ONNX op a case tests (an `_expanded` case tests the op it expands)."""
    cases = node_cases()
    base = re.sub(r"_expanded.*$", "", name)
    ops = [node.op_type for node in cases.get(base, cases[name]).model.graph.node
           if node.op_type != "Constant"]
    return ops[-1] if ops else "Constant"


def spread_per_op(names: list[str], per_op: int) -> list[str]:
    """At most `per_op` of `names` for each op (`case_op`), spread evenly over that op's cases
    in name order: its first and last case and those between (its first alone when `per_op` is
    1), so that a sample keeps each op's variants apart (attributes, ranks, types, the
    `_expanded` graph). The names come back sorted."""
    by_op: dict[str, list[str]] = defaultdict(list)
    for name in sorted(names):
        by_op[case_op(name)].append(name)
    sample = []
    for cases in by_op.values():
        if len(cases) <= per_op:
            sample += cases
        elif per_op == 1:
            sample.append(cases[0])
        else:
            sample += [cases[round(i * (len(cases) - 1) / (per_op - 1))] for i in range(per_op)]
    return sorted(sample)


def as_array(value):
    """A case's input or output as onnx's runner hands it over: an array, or None when it is a
    sequence, map or optional."""
    if isinstance(value, onnx.TensorProto):
        return onnx.numpy_helper.to_array(value)
    if isinstance(value, (np.ndarray, np.generic)):
        return np.asarray(value)
    return None


def unsupported_dtypes(model: onnx.ModelProto) -> list[str]:
    """Element types outside SUPPORTED_DTYPES that the model's tensors or casts use."""
    from tvm.relax.frontend.onnx.onnx_frontend import get_type

    graph = model.graph
    elem_types = {value.type.tensor_type.elem_type for value in [*graph.input, *graph.output]
                  if value.type.HasField("tensor_type")}
    elem_types |= {tensor.data_type for tensor in graph.initializer}
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.name in ("to", "dtype", "output_dtype") and attribute.type == onnx.AttributeProto.INT:
                elem_types.add(attribute.i)
            elif attribute.type == onnx.AttributeProto.TENSOR:
                elem_types.add(attribute.t.data_type)
    return sorted({get_type(t) for t in elem_types if t} - SUPPORTED_DTYPES)


def run_case(case, engine: str) -> tuple[str, str]:
    """(status, reason) of one case on one engine, in this process."""
    from onnx.backend.test.runner import Runner

    from .errors import UnsupportedOperatorError

    data_sets = [([as_array(value) for value in inputs], [as_array(value) for value in expected])
                 for inputs, expected in case.data_sets]
    for inputs, expected in data_sets:
        if any(value is None for value in inputs + expected):
            return NOT_SUPPORTED, "inputs or outputs are sequences or optionals"
    try:
        run = _prepare(case.model, engine)
        for inputs, expected in data_sets:
            outputs = run(inputs)
            Runner.assert_similar_outputs(expected, outputs, rtol=case.rtol, atol=case.atol)
    except UnsupportedOperatorError as err:
        return NOT_SUPPORTED, str(err)
    except Exception as err:  # every other error is a failure of this engine on this case
        if type(err).__name__ == "OpNotImplemented":
            return NOT_SUPPORTED, _one_line(err)
        if isinstance(err, AssertionError):
            return FAIL, "wrong output: " + _one_line(err)
        return FAIL, f"{type(err).__name__}: {_one_line(err)}"
    return PASS, ""


def _prepare(model: onnx.ModelProto, engine: str):
    if engine == "tightfit":
        return TightfitBackend.prepare(model).run
    if engine == "tvm":
        import tvm
        from tvm import relax
        from tvm.relax.frontend.onnx import from_onnx

        from .session import _flatten

        executable = tvm.compile(from_onnx(model), tvm.target.Target({"kind": "llvm"}))
        vm = relax.VirtualMachine(executable, tvm.cpu())
        return lambda inputs: [t.numpy() for t in _flatten(vm["main"](*[tvm.runtime.tensor(x) for x in inputs]))]
    raise ValueError(f"unknown engine {engine!r}; use tightfit or tvm")


def _one_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return (lines[-1] if lines else type(error).__name__)[:240]


# --- the runner ------------------------------------------------------------------------------------

def run_node_tests(engine: str = "tightfit", pattern: str | None = None, jobs: int = 1,
                   json_path: str | None = None, names: list[str] | None = None,
                   progress: bool = True) -> list[CaseResult]:
    """Run the node cases (all, or `names`; those matching `pattern`) in `jobs` workers."""
    cases = node_cases()
    selected = [name for name in (names if names is not None else sorted(cases))
                if pattern is None or re.search(pattern, name)]
    ops = {name: case_op(name) for name in selected}
    results: list[CaseResult] = []
    pending = list(reversed(selected))
    workers = [_Worker(engine) for _ in range(max(1, min(jobs, len(selected))))]
    from tqdm import tqdm

    bar = tqdm(total=len(selected), desc=f"conformance {engine}", unit="case", disable=not progress,
               file=sys.stderr)
    try:
        while pending or any(worker.current for worker in workers):
            for worker in workers:
                if worker.current is None and pending:
                    worker.send(pending.pop())
            _wait_for_a_reply([worker for worker in workers if worker.current], POLL_S)
            for worker in workers:
                finished = worker.poll()
                if finished is not None:
                    name, status, reason, seconds = finished
                    exotic = unsupported_dtypes(cases[name].model) if status == FAIL else []
                    if exotic:  # failed, crashed or timed out on a type outside tightfit's scope
                        status, reason = NOT_SUPPORTED, f"uses element types {', '.join(exotic)}: {reason}"
                    results.append(CaseResult(name, ops[name], status, reason, round(seconds, 3)))
                    bar.update(1)
    finally:
        bar.close()
        for worker in workers:
            worker.stop()
    results.sort(key=lambda result: result.name)
    if json_path:
        with open(json_path, "w") as out:
            json.dump({"engine": engine, "summary": summarize(results),
                       "cases": [asdict(r) for r in results]}, out, indent=1)
    return results


def selected_cases(cases_file: str | None, per_op: int | None) -> list[str] | None:
    """The case names the command line's --cases and --per-op select (None: every case, or
    those --pattern matches). A bad option is a ValueError that says what to pass instead."""
    if per_op is not None and per_op < 1:
        raise ValueError(f"--per-op {per_op}: pass 1 or more")
    if cases_file is None:
        return None if per_op is None else spread_per_op(sorted(node_cases()), per_op)
    try:
        names = Path(cases_file).read_text().split()
    except OSError as err:
        raise ValueError(f"--cases {cases_file}: {err.strerror}; pass a file of case names") from None
    unknown = [name for name in names if name not in node_cases()]
    if unknown:
        raise ValueError(f"--cases {cases_file} names cases the installed onnx "
                         f"{onnx.__version__} lacks: {unknown[:5]}")
    return names if per_op is None else spread_per_op(names, per_op)


def _wait_for_a_reply(workers: list[_Worker], timeout: float) -> None:
    """Until one of `workers` has written a reply (or died), at most `timeout` seconds: waiting
    on each in turn, a reply sat unread while the loop waited on another worker."""
    with selectors.DefaultSelector() as selector:
        for worker in workers:
            selector.register(worker.process.stdout, selectors.EVENT_READ)
        if workers:
            selector.select(timeout=timeout)


class _Worker:
    """A process running cases one at a time; replaced when it dies or overruns a case."""

    def __init__(self, engine: str):
        self.engine = engine
        self.current: str | None = None
        self.started = 0.0
        self._start()

    def _start(self):
        environment = dict(os.environ, TVM_NUM_THREADS="1")  # workers run side by side
        self.process = subprocess.Popen(worker_command("tightfit.conformance", "--worker", self.engine),
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True, env=environment)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.process.stdout, selectors.EVENT_READ)
        self.ready = False

    def _await_ready(self):
        if not self.selector.select(timeout=WORKER_START_TIMEOUT_S) \
                or self.process.stdout.readline().strip() != READY:
            self.stop()
            raise RuntimeError(f"a conformance worker ({self.engine}) did not start within "
                               f"{WORKER_START_TIMEOUT_S} s; run `python -m tightfit.conformance "
                               f"--worker {self.engine}` to see why")
        self.ready = True

    def send(self, name: str):
        if not self.ready:
            self._await_ready()
        self.current, self.started = name, time.monotonic()
        self.process.stdin.write(name + "\n")
        self.process.stdin.flush()

    def poll(self):
        """The finished case's (name, status, reason, seconds), or None while it runs."""
        if self.current is None:
            return None
        if self.selector.select(timeout=0):
            line = self.process.stdout.readline()
            if line:
                reply = json.loads(line)
                self.current = None
                return reply["name"], reply["status"], reply["reason"], reply["seconds"]
            return self._replace("worker crashed")
        if time.monotonic() - self.started > CASE_TIMEOUT_S:
            return self._replace(f"timed out after {CASE_TIMEOUT_S} s")
        return None

    def _replace(self, reason: str):
        name, seconds = self.current, time.monotonic() - self.started
        self.stop()
        self.current = None
        self._start()
        return name, FAIL, reason, seconds

    def stop(self):
        self.process.kill()
        self.process.wait()


def _worker_main(engine: str) -> None:
    replies = sys.stdout
    sys.stdout = sys.stderr  # converters print diagnostics; only replies go to the parent
    cases = node_cases()
    from onnx.backend.test.runner import Runner  # noqa: F401 - imported before the first case

    from . import api  # noqa: F401
    replies.write(READY + "\n")
    replies.flush()
    for line in sys.stdin:
        name = line.strip()
        started = time.perf_counter()
        status, reason = run_case(cases[name], engine)
        replies.write(json.dumps({"name": name, "status": status, "reason": reason,
                                  "seconds": time.perf_counter() - started}) + "\n")
        replies.flush()


# --- reports ---------------------------------------------------------------------------------------

def summarize(results: list[CaseResult]) -> dict:
    totals = Counter(result.status for result in results)
    return {"cases": len(results), PASS: totals[PASS], FAIL: totals[FAIL],
            NOT_SUPPORTED: totals[NOT_SUPPORTED]}


def per_op_table(results: list[CaseResult]) -> str:
    by_op: dict[str, Counter] = defaultdict(Counter)
    for result in results:
        by_op[result.op][result.status] += 1
    lines = [f"{'op':28} {'pass':>5} {'fail':>5} {'n/s':>5}"]
    for op in sorted(by_op):
        counts = by_op[op]
        lines.append(f"{op:28} {counts[PASS]:5d} {counts[FAIL]:5d} {counts[NOT_SUPPORTED]:5d}")
    summary = summarize(results)
    lines.append(f"{'total':28} {summary[PASS]:5d} {summary[FAIL]:5d} {summary[NOT_SUPPORTED]:5d}"
                 f"   of {summary['cases']} cases")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tightfit conformance", description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["tightfit", "tvm"], default="tightfit")
    parser.add_argument("--pattern", help="only cases whose name matches this regular expression")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--json", help="write every case's result to this file")
    parser.add_argument("--cases", metavar="FILE", help="only the cases this file names (whitespace-separated)")
    parser.add_argument("--per-op", type=int, help="at most this many cases of each op, spread over its cases")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker_main(args.worker)
        return 0
    try:
        names = selected_cases(args.cases, args.per_op)
    except ValueError as err:
        parser.error(str(err))
    results = run_node_tests(args.engine, args.pattern, args.jobs, args.json, names=names)
    print(per_op_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
