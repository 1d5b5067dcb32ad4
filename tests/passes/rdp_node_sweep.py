"""RDP soundness over the ONNX backend node tests, with every input dim made symbolic.

The node tests (shipped in `onnx`) cover every op with fixed inputs. Imported with each input
dim a symbol of its own (`x_d0`, `x_d1`, ...), a case becomes a dynamic-shape model whose shapes
and shape values RDP must predict symbolically; running it on the case's own inputs (the probe of
`shape_probe`) checks every prediction, and the outputs of RDP's rewritten module must still equal
the case's expected outputs. A case that does not import or compile with symbolic dims even
without RDP is counted `not-symbolic`, not held against RDP; one whose module compiles before RDP
and not after is a failure.

    python tests/passes/rdp_node_sweep.py [--pattern REGEX] [--jobs N] [--out results.json]

Cases run in worker processes (TVM can abort a process), each with a time limit.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import onnx

HERE = Path(__file__).resolve().parent
PASSING_LIST = HERE.parent / "data" / "onnx_node_passing.txt"
CASE_TIMEOUT_S = 60
SOUND, UNSOUND, ERROR, NOT_SYMBOLIC = "sound", "unsound", "error", "not-symbolic"


def symbolic_shapes(model, data: list, tied: bool = False) -> dict[str, list]:
    """A symbol per dim of every graph input that is not an initializer, except the length of
    integer vectors and scalars: those are shapes, axes or counts, whose length the importer
    needs (a Reshape target of unknown length has no rank).

    `tied`: dims of the same size in the case's data share a symbol (`n3`), and dims of size 1
    stay 1 — broadcasting between unrelated symbols is something Relax cannot lower, so most
    element-wise cases are symbolic only this way."""
    initializers = {init.name for init in model.graph.initializer}
    integer_types = {onnx.TensorProto.INT64, onnx.TensorProto.INT32}
    inputs = [value for value in model.graph.input if value.name not in initializers]
    shapes = {}
    for value, array in zip(inputs, data):
        if not value.type.HasField("tensor_type"):
            continue
        tensor_type = value.type.tensor_type
        rank = len(tensor_type.shape.dim)
        if tensor_type.elem_type in integer_types and rank <= 1:
            continue
        if tied:
            shapes[value.name] = [1 if size == 1 else f"n{size}" for size in np.shape(array)]
        else:
            shapes[value.name] = [f"{_identifier(value.name)}_d{axis}" for axis in range(rank)]
    return shapes


def _identifier(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name) or "input"


def check_case(case, baseline_only: bool = False) -> tuple[str, str, int]:
    """(status, reason, claims compared) of one node case; `baseline_only` runs the module
    without RDP and stops (to tell a crash of RDP's module from one of the import)."""
    import numpy as np
    from onnx.backend.test.runner import Runner

    from predictions import Check
    from shape_probe import ShapeProbe
    from test_rdp_soundness import compare
    from test_shape_probe import normalizing_passes
    from tightfit.conformance import as_array
    from tightfit.frontend import import_onnx
    from tightfit.passes.classify_dynamism import ClassifyDynamism
    from tightfit.passes.rdp import RankDimensionPropagation, analyze_module
    from tightfit.target import resolve_target
    import tvm

    data_sets = [([as_array(v) for v in inputs], [as_array(v) for v in expected])
                 for inputs, expected in case.data_sets]
    if any(v is None for inputs, expected in data_sets for v in inputs + expected):
        return NOT_SYMBOLIC, "sequence or optional values", 0
    target = resolve_target("host")

    def symbolic_module(tied: bool):
        mod = import_onnx(case.model, symbolic_shapes(case.model, data_sets[0][0], tied)).mod
        with target.tvm_target, tvm.transform.PassContext(opt_level=3):
            for compiler_pass in normalizing_passes(target):
                mod = compiler_pass(mod)
        mod = ClassifyDynamism()(mod)
        # In scope: it runs, and gives the expected outputs, with symbolic dims but without RDP.
        baseline = ShapeProbe(mod)
        for inputs, expected in data_sets:
            Runner.assert_similar_outputs(expected, baseline.run(inputs)[1], rtol=case.rtol,
                                          atol=case.atol)
        return mod

    try:
        mod = symbolic_module(tied=False)
    except Exception:
        try:
            mod = symbolic_module(tied=True)
        except Exception as err:
            return NOT_SYMBOLIC, f"{type(err).__name__}: {_line(err)}", 0
    if baseline_only:
        return SOUND, "runs without RDP", 0
    try:
        result = analyze_module(mod)
        rewritten = RankDimensionPropagation()(mod)
        probe = ShapeProbe(rewritten)
    except Exception as err:
        return ERROR, f"RDP or its rewrite: {type(err).__name__}: {_line(err)}", 0
    facts = {var.name: fact for var, fact in result.facts.items()}
    params = mod["main"].params
    compared = 0
    for inputs, expected in data_sets:
        try:
            observed, outputs = probe.run(inputs)
        except Exception as err:
            return ERROR, f"the rewritten module fails at run time: {_line(err)}", compared
        try:
            Runner.assert_similar_outputs(expected, outputs, rtol=case.rtol, atol=case.atol)
        except AssertionError as err:
            return UNSOUND, f"outputs changed: {_line(err)}", compared
        env = {}
        for param, array in zip(params, inputs):
            for dim, size in zip(getattr(param.ty.shape, "values", []), np.shape(array)):
                if isinstance(dim, tvm.tirx.Var):
                    env.setdefault(dim, int(size))
        check = Check(env)
        for name, observation in observed.items():
            if name in facts:
                compare(check, name, facts[name], observation)
        check.finish()
        compared += check.compared
        if check.mismatches:
            return UNSOUND, f"{check.mismatches[:3]}", compared
    return SOUND, "", compared


def _line(err: Exception) -> str:
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return (lines[-1] if lines else type(err).__name__)[:300]


def _worker() -> None:
    """Read case names on stdin, write one JSON result per line."""
    import warnings

    sys.path.insert(0, str(HERE))
    from tightfit.conformance import node_cases

    warnings.simplefilter("ignore")
    cases = node_cases()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        name, _, mode = line.strip().partition(" ")
        started = time.perf_counter()
        status, reason, compared = check_case(cases[name], baseline_only=mode == "baseline")
        print(json.dumps({"name": name, "status": status, "reason": reason, "compared": compared,
                          "seconds": round(time.perf_counter() - started, 2)}), flush=True)


class _Worker:
    def __init__(self):
        self.process = subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.process.stdout.readline()  # ready

    def run(self, name: str, mode: str = "") -> dict:
        self.process.stdin.write(f"{name} {mode}\n")
        self.process.stdin.flush()
        line = _readline(self.process, CASE_TIMEOUT_S)
        if line is None:
            self.process.kill()
            self.process.wait()
            return {"name": name, "status": ERROR, "reason": "crashed or timed out", "compared": 0}
        return json.loads(line)


def _readline(process, timeout: float) -> str | None:
    import selectors

    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    if not selector.select(timeout):
        return None
    line = process.stdout.readline()
    return line or None


def sweep(names: list[str], jobs: int = 1, progress=None) -> list[dict]:
    """Every case in `names`, over `jobs` worker processes (replaced when one dies)."""
    from concurrent.futures import ThreadPoolExecutor

    def run_chunk(chunk: list[str]) -> list[dict]:
        results, worker = [], _Worker()
        for name in chunk:
            result = worker.run(name)
            if result["reason"] == "crashed or timed out":
                worker = _Worker()
                baseline = worker.run(name, "baseline")
                if baseline["status"] != SOUND:  # it crashes without RDP too: not RDP's doing
                    result = {**result, "status": NOT_SYMBOLIC, "reason": "crashes without RDP too"}
            results.append(result)
            if progress:
                progress(result)
            if worker.process.poll() is not None:  # it crashed or was killed: a fresh one
                worker = _Worker()
        worker.process.kill()
        return results

    chunks = [names[index::jobs] for index in range(jobs)]
    with ThreadPoolExecutor(jobs) as pool:
        return [result for chunk in pool.map(run_chunk, chunks) for result in chunk]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pattern", help="only cases whose name matches this regular expression")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--out", help="write every case's result as JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker()
        return 0
    names = PASSING_LIST.read_text().split()
    if args.pattern:
        names = [name for name in names if re.search(args.pattern, name)]
    started = time.perf_counter()
    results = sweep(names, args.jobs, progress=lambda r: print(
        f"{r['status']:12s} {r['name']} {r.get('reason', '')[:160]}", flush=True))
    counts = Counter(result["status"] for result in results)
    claims = sum(result["compared"] for result in results)
    print(f"{len(results)} cases in {time.perf_counter() - started:.0f} s: {dict(counts)}; "
          f"{claims} predictions compared")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 1 if counts[UNSOUND] or counts[ERROR] else 0


if __name__ == "__main__":
    sys.exit(main())
