"""Targets: what tightfit compiles for, from a short name or a TVM target dict.

`"host"` is this machine's CPU (its LLVM CPU name and core count); anything else is a TVM target
given as a dict or JSON string, e.g. `{"kind": "llvm", "mtriple": "aarch64-linux-gnu",
"mattr": ["+neon"]}`, or a device: a preset name (`tightfit devices` lists them) or a device
description .json file (see tightfit.device_rpc.devices). A device's library is linked by its
cross compiler; a bare target dict for another CPU family gets the Arm64 Linux one.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass, replace

import tvm

from .errors import TargetError


@dataclass(frozen=True)
class CompileTarget:
    """A TVM target plus what the runtime needs to know about it."""

    name: str
    tvm_target: tvm.target.Target
    num_threads: int
    cross_compiler: str | None = None  # links the exported library; None: the host's compiler

    @property
    def is_host(self) -> bool:
        return self.name == "host"

    def to_json(self) -> dict:
        return {"name": self.name, "tvm_target": str(self.tvm_target), "num_threads": self.num_threads,
                "cross_compiler": self.cross_compiler}

    @property
    def runs_on_host(self) -> bool:
        """Whether this machine can run what is compiled for the target."""
        triple = str(self.tvm_target.attrs.get("mtriple", ""))
        return not triple or triple.split("-")[0] == platform.machine()

    def code_generation(self, fast_math: bool = True) -> tvm.target.Target:
        """The TVM target LLVM generates this target's code for (`code_generation_target`)."""
        return code_generation_target(self.tvm_target, fast_math)


def code_generation_target(tvm_target: tvm.target.Target, fast_math: bool = True) -> tvm.target.Target:
    """The TVM target LLVM generates `tvm_target`'s code for.

    With `fast_math` (PipelineOptions.fast_math), float additions may be reassociated
    (LLVM's `reassoc` flag), which lets the loop vectorizer vectorize the reductions the
    fallback schedule leaves as loops: a global average pool over 2 x 16 x 48 x 40 went
    from 49 to 12 us, softmax and layer-norm sums vectorize too. Sums then differ from
    onnxruntime's in the last bits, as onnxruntime's own vectorized sums do. A target that
    sets `fast-math-reassoc` itself is kept as it is.

    LLVM's SLP vectorizer is off (`-vectorize-slp=false`; TVM scopes the option to this
    target's code generation): with it, LLVM 22 computed an attention mask wrong for
    AVX-512 at optimization level 3 (tests/test_codegen_target.py). tightfit's hot kernels
    are vectorized by their schedules, so SLP only reaches the scalar rest: every zoo model
    ran within -3% to +4% of its time with SLP, 0.3% slower in the geomean (x86 with
    AVX-512; not measured on Arm64). A target that names `vectorize-slp` in its `cl-opt`
    is kept as it is.

    The compile, the knob search and MetaSchedule tuning (both time kernels as they will
    run) build with it."""
    if tvm_target.kind.name != "llvm":
        return tvm_target
    description = dict(tvm_target.export())
    description.pop("tag", None)
    description["keys"] = list(description["keys"])
    if fast_math and "fast-math-reassoc" not in tvm_target.attrs:
        description["fast-math-reassoc"] = True
    llvm_options = [str(option) for option in tvm_target.attrs.get("cl-opt", [])]
    if not any("vectorize-slp" in option for option in llvm_options):
        description["cl-opt"] = [*llvm_options, "-vectorize-slp=false"]
    return tvm.target.Target(description)


def host_thread_count() -> int:
    """Cores this process may run on (respects taskset/cgroup affinity)."""
    return len(os.sched_getaffinity(0))


def resolve_target(target: str | dict | CompileTarget = "host") -> CompileTarget:
    """Turn a user's target spelling into a CompileTarget, or say what spellings work."""
    if isinstance(target, CompileTarget):
        return target
    if target == "host":
        threads = host_thread_count()
        cpu = tvm.target.codegen.llvm_get_system_cpu()
        return CompileTarget("host", tvm.target.Target({"kind": "llvm", "mcpu": cpu,
                                                        "num-cores": threads}), threads)
    if isinstance(target, str) and not target.lstrip().startswith("{"):
        return _device_target(target)
    if isinstance(target, str):
        try:
            target = json.loads(target)
        except json.JSONDecodeError as err:
            raise TargetError(
                f"unknown target {target!r}; use 'host' or a TVM target as JSON, e.g. "
                '\'{"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]}\''
            ) from err
    try:
        tvm_target = tvm.target.Target(target)
    except Exception as err:  # TVM raises its own error types for bad target dicts
        raise TargetError(f"TVM rejects target {target}: {err}") from err
    threads = int(tvm_target.attrs.get("num-cores", 0)) or host_thread_count()
    compile_target = CompileTarget(json.dumps(target, sort_keys=True), tvm_target, threads)
    if not compile_target.runs_on_host and "aarch64" in str(tvm_target.attrs.get("mtriple", "")):
        return replace(compile_target, cross_compiler="aarch64-linux-gnu-g++")
    return compile_target


def _device_target(name_or_path: str) -> CompileTarget:
    from .device_rpc.devices import load_device

    try:
        device = load_device(name_or_path)
    except TargetError as err:
        raise TargetError(f"{err}; or use 'host', or a TVM target as JSON, e.g. "
                          '\'{"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]}\'') from None
    tvm_target = tvm.target.Target(device.target)
    threads = int(tvm_target.attrs.get("num-cores", 0)) or 1
    return CompileTarget(device.name, tvm_target, threads, device.cross_compiler)
