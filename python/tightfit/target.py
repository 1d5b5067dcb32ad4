"""Targets: what tightfit compiles for, from a short name or a TVM target dict.

`"host"` is this machine's CPU (its LLVM CPU name and core count); anything else is a TVM target
given as a dict or JSON string, e.g. `{"kind": "llvm", "mtriple": "aarch64-linux-gnu",
"mattr": ["+neon"]}`. Device presets (phones and boards) come with the device issue.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import tvm

from .errors import TargetError


@dataclass(frozen=True)
class CompileTarget:
    """A TVM target plus what the runtime needs to know about it."""

    name: str
    tvm_target: tvm.target.Target
    num_threads: int

    @property
    def is_host(self) -> bool:
        return self.name == "host"

    def to_json(self) -> dict:
        return {"name": self.name, "tvm_target": str(self.tvm_target), "num_threads": self.num_threads}


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
    return CompileTarget(json.dumps(target, sort_keys=True), tvm_target, threads)
