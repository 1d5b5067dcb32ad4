"""Where a run's time goes: each compiled kernel timed with the arguments of a real run.

TVM 0.27's Relax VM has no profiler, but it calls an instrument before every call it makes.
`profile_kernels` runs the model once with an instrument that, before each call of a compiled
kernel, times that call on its actual arguments with TVM's time evaluator (`number` calls, the
best of `repeat`; a kernel that is called several times is timed at each call). The rest of a
run (the VM's own instructions, its builtins: allocation, shape checks, tensor views) shows as
the difference between the whole run, timed separately, and the kernels' sum.

Host sessions only: over RPC the instrument would run on the device, where Python is not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from .errors import TargetError


@dataclass
class KernelTime:
    name: str
    calls: int
    seconds: float  # summed over its calls in one run
    argument_shapes: list  # of the first call: a tuple per tensor, the value of a scalar


@dataclass
class Profile:
    kernels: list[KernelTime]  # most time first
    run_seconds: float  # median of whole runs, timed inside the VM

    @property
    def kernel_seconds(self) -> float:
        return sum(kernel.seconds for kernel in self.kernels)

    def table(self) -> str:
        lines = [f"{'us':>9} {'share':>6} {'calls':>5}  kernel (argument shapes of the first call)"]
        for kernel in self.kernels:
            shapes = ", ".join(_show(shape) for shape in kernel.argument_shapes)
            lines.append(f"{kernel.seconds * 1e6:9.2f} {kernel.seconds / self.run_seconds:6.1%} "
                         f"{kernel.calls:5d}  {kernel.name} ({shapes})")
        rest = self.run_seconds - self.kernel_seconds
        lines.append(f"{self.kernel_seconds * 1e6:9.2f} {self.kernel_seconds / self.run_seconds:6.1%} "
                     f"{sum(k.calls for k in self.kernels):5d}  all kernels")
        lines.append(f"{rest * 1e6:9.2f} {rest / self.run_seconds:6.1%} {'':5}  the rest (VM "
                     "instructions and builtins: allocation, shape checks, views; can be < 0 "
                     "when kernels run faster in a whole run)")
        lines.append(f"{self.run_seconds * 1e6:9.2f} {1:6.0%} {'':5}  whole run (median)")
        return "\n".join(lines)

    def as_json(self) -> dict:
        return {"run_seconds": self.run_seconds,
                "kernels": [{"name": k.name, "calls": k.calls, "seconds": k.seconds,
                             "argument_shapes": [list(s) if isinstance(s, tuple) else s
                                                 for s in k.argument_shapes]}
                            for k in self.kernels]}


def profile_kernels(session, feeds: dict[str, np.ndarray], number: int = 20,
                    repeat: int = 3) -> Profile:
    """Time every kernel call of one run of `session` on `feeds` (a host session)."""
    if session.remote is not None:
        raise TargetError("profiling runs on the host only; time a device with `tightfit bench "
                          "--rpc-tracker HOST:PORT --rpc-key KEY`")
    kernels_module = _kernel_library(session.executable)
    by_name: dict[str, KernelTime] = {}

    def instrument(func, symbol, before_run, return_value, *arguments):
        if before_run and kernels_module.implements_function(symbol):
            timer = kernels_module.time_evaluator(symbol, session.device, number=number,
                                                  repeat=repeat)
            seconds = min(timer(*arguments).results)
            entry = by_name.setdefault(symbol, KernelTime(symbol, 0, 0.0, [
                tuple(argument.shape) if hasattr(argument, "shape") else argument
                for argument in arguments]))
            entry.calls += 1
            entry.seconds += seconds
        return 0  # VMInstrumentReturnKind.NO_OP: run the call as usual

    # whole runs first: the first kernels timed right after compiling ran up to 2x slow
    # (thread pool, caches and clock still cold), more than any real difference between them
    session.time_run(feeds, number=5, repeat=3)
    # a VM of its own: an instrument cannot be taken off again, and would slow every later run
    profiled_vm = relax.VirtualMachine(session.executable, session.device)
    profiled_vm.set_instrument(instrument)
    profiled_vm["main"](*session.prepare_inputs(feeds), *session.weights)
    run_seconds = float(np.median(session.time_run(feeds, repeat=max(20, repeat))))
    return Profile(sorted(by_name.values(), key=lambda k: -k.seconds), run_seconds)


def _kernel_library(executable) -> tvm.runtime.Module:
    """The module holding the compiled kernels: the VM executable imports it."""
    module = executable.mod if hasattr(executable, "mod") else executable
    imports = list(module.imports)
    if not imports:
        raise TargetError("this executable has no kernel library to profile")
    return imports[0]


def _show(shape) -> str:
    if isinstance(shape, tuple):
        return "x".join(str(d) for d in shape) if shape else "scalar"
    return str(shape)
