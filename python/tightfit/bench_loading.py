"""Benchmark of loading: time to a ready session, and peak RSS while getting there.

Issue 4's measurement of the packed-weight file. Each case runs in a fresh process (peak RSS
minus that of a process that only imports the same libraries):
- tightfit cold build: compile from ONNX, write the package, open a session;
- tightfit warm load: open the written package (weights mapped, no copy) and a session;
- TVM default, build: `from_onnx` + `tvm.compile` with the weights bound as constants into the
  library (TVM's default way of holding parameters), export, create the VM;
- TVM default, load: load that library and create the VM;
- load+run, for both: the load followed by one run at the first shape set (dynamic dims 1), which
  is when mapped weights are first read.
A warm load should cost a small fraction of a build, and its peak RSS should not include a second
copy of the weights.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import onnx

from .bench import run_job_io, run_worker
from .feeds import concrete_shapes
from .frontend import declared_inputs

CASES = [("tightfit build", "build-tightfit"), ("tightfit load", "load-tightfit"),
         ("tightfit load+run", "run-tightfit"), ("tvm-default build", "build-tvm-default"),
         ("tvm-default load", "load-tvm-default"), ("tvm-default load+run", "run-tvm-default")]


@dataclass
class LoadingResult:
    model: str
    weight_mb: float
    seconds: dict[str, float]
    peak_rss_mb: dict[str, float]
    failures: dict[str, str]


def benchmark_loading(model: str | Path | onnx.ModelProto, name: str,
                      shapes: dict[str, tuple[int, ...]] | None = None) -> LoadingResult:
    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))
    if shapes is None:
        shapes = concrete_shapes(declared_inputs(proto.graph), {}, default_dim=1)
    weight_bytes = sum(onnx.numpy_helper.to_array(t).nbytes for t in proto.graph.initializer)
    with tempfile.TemporaryDirectory(prefix="tightfit-load-") as scratch:
        model_path = Path(scratch) / "model.onnx"
        onnx.save(proto, str(model_path))
        io = run_job_io(proto, shapes)
        del proto  # the parent should not hold the weights while children are measured
        artifacts = {"tightfit": str(Path(scratch) / "model.tfpkg"),
                     "tvm-default": str(Path(scratch) / "tvm_default.so")}
        baseline = run_worker({"job": "import-only"})["peak_rss_kib"]
        seconds, peaks, failures = {}, {}, {}
        for label, job in CASES:  # builds come first: each load reads what its build wrote
            engine = "tightfit" if "tightfit" in job else "tvm-default"
            if f"{engine} build" in failures:
                failures[label] = "not run: the build failed"
                continue
            try:
                measured = run_worker({"job": job, "model": str(model_path),
                                       "artifact": artifacts[engine], **io})
            except RuntimeError as err:  # e.g. stock TVM cannot import the model
                failures[label] = str(err)
                continue
            seconds[label] = round(measured["seconds"], 3)
            peaks[label] = round((measured["peak_rss_kib"] - baseline) / 1024, 1)
    return LoadingResult(name, round(weight_bytes / 2**20, 1), seconds, peaks, failures)


def loading_table(results: list[LoadingResult]) -> str:
    labels = [label for label, _ in CASES]
    lines = ["| model | weights MB | " + " | ".join(f"{label} s / MB" for label in labels) + " |",
             "|---|---|" + "---|" * len(labels)]
    for result in results:
        cells = [f"{result.seconds[label]:.2f} s / {result.peak_rss_mb[label]:.0f} MB"
                 if label in result.seconds else "failed" for label in labels]
        lines.append(f"| {result.model} | {result.weight_mb:.1f} | " + " | ".join(cells) + " |")
    failures = [f"- {r.model} / {label}: {why}" for r in results for label, why in r.failures.items()]
    lines += ["", "Failures:", *failures] if failures else []
    lines += ["", "Time to a ready session and peak RSS above a process that only imports the "
              "libraries, each case in a fresh process."]
    return "\n".join(lines)


def write_loading_reports(results: list[LoadingResult], directory: str | Path) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "loading.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    path = directory / "loading.md"
    path.write_text(loading_table(results) + "\n")
    return path
