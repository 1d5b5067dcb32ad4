"""Where a run's time goes: each kernel call of a run timed with its real arguments.

TVM 0.27's Relax VM has no profiler, but it calls an instrument before and after every call it
makes. Each kernel is timed two ways:
- alone: before each call of a compiled kernel, TVM's time evaluator runs that call on its
  actual arguments (`number` calls, the best of `repeat`), its data hot in the caches;
- in a run: the time between the instrument's calls before and after the kernel, in whole
  runs (the median over IN_RUN_RUNS runs), its inputs where the kernels before it left them:
  in the other core's cache, or in memory. The difference is what a layer loses to its
  neighbours (MobileNetV2's 576 -> 96 projections at 14x14: 75 us alone, 200 us in a run).
  It includes the instrument's own return into and call from Python, about a microsecond.
The rest of a run (the VM's own instructions, its builtins: allocation, shape checks, tensor
views, and the instrument's calls around each of them) is the difference between those
instrumented runs and their kernels' sum. Instrumented runs run the bytecode copy of the model
(vm_code.py), the only code whose kernel calls an instrument sees; the whole run is also timed
without the instrument, as the model runs: native.

A row is one call site: the n-th call of a kernel in a run. Layers that repeat compile to one
kernel (ShareIdenticalKernels), and each layer keeps its row, so what one of them loses to its
neighbours stays visible.

Host sessions only: over RPC the instrument would run on the device, where Python is not.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from .errors import TargetError
from .vm_code import interpreted


IN_RUN_RUNS = 21


@dataclass
class KernelTime:
    name: str
    call: int  # which call of the kernel in a run, from 1
    seconds: float  # this call alone
    argument_shapes: list  # a tuple per tensor, the value of a scalar
    calls: int = 1  # the kernel's calls in a run
    in_run_seconds: float = 0.0  # this call in whole runs (median)


@dataclass
class Profile:
    kernels: list[KernelTime]  # most time in a run first
    run_seconds: float  # median of whole runs, timed inside the VM
    instrumented_run_seconds: float  # median of the runs that timed the kernels in a run

    @property
    def kernel_seconds(self) -> float:
        return sum(kernel.seconds for kernel in self.kernels)

    @property
    def in_run_kernel_seconds(self) -> float:
        return sum(kernel.in_run_seconds for kernel in self.kernels)

    def table(self) -> str:
        lines = [f"{'alone us':>9} {'in run us':>9} {'share':>6} {'call':>5}  kernel (argument "
                 "shapes); share: of the profiled whole run; call: which of the kernel's calls"]
        for kernel in self.kernels:
            shapes = ", ".join(_show(shape) for shape in kernel.argument_shapes)
            lines.append(f"{kernel.seconds * 1e6:9.2f} {kernel.in_run_seconds * 1e6:9.2f} "
                         f"{kernel.in_run_seconds / self.instrumented_run_seconds:6.1%} "
                         f"{f'{kernel.call}/{kernel.calls}':>5}  {kernel.name} ({shapes})")
        in_run = self.in_run_kernel_seconds
        total = self.instrumented_run_seconds
        rest = total - in_run
        lines.append(f"{self.kernel_seconds * 1e6:9.2f} {in_run * 1e6:9.2f} "
                     f"{in_run / total:6.1%} {len(self.kernels):5d}  all kernel calls")
        lines.append(f"{'':9} {rest * 1e6:9.2f} {rest / total:6.1%} {'':5}  the rest (VM "
                     "instructions and builtins: allocation, shape checks, views; the profiler's "
                     "calls around them)")
        lines.append(f"{'':9} {total * 1e6:9.2f} {1:6.0%} {'':5}  whole run, profiled (median)")
        lines.append(f"{'':9} {self.run_seconds * 1e6:9.2f} {'':6} {'':5}  whole run, not "
                     "profiled (median)")
        return "\n".join(lines)

    def as_json(self) -> dict:
        return {"run_seconds": self.run_seconds,
                "instrumented_run_seconds": self.instrumented_run_seconds,
                "kernels": [{"name": k.name, "call": k.call, "calls": k.calls, "seconds": k.seconds,
                             "in_run_seconds": k.in_run_seconds,
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
    call_sites: dict[tuple[str, int], KernelTime] = {}
    calls_of: Counter[str] = Counter()  # (kernel, n-th call) names a call site

    def instrument(func, symbol, before_run, return_value, *arguments):
        if before_run and kernels_module.implements_function(symbol):
            timer = kernels_module.time_evaluator(symbol, session.device, number=number,
                                                  repeat=repeat)
            calls_of[symbol] += 1
            call = calls_of[symbol]
            call_sites[symbol, call] = KernelTime(symbol, call, min(timer(*arguments).results), [
                tuple(argument.shape) if hasattr(argument, "shape") else argument
                for argument in arguments])
        return 0  # VMInstrumentReturnKind.NO_OP: run the call as usual

    # whole runs first: the first kernels timed right after compiling ran up to 2x slow
    # (thread pool, caches and clock still cold), more than any real difference between them
    session.time_run(feeds, number=5, repeat=3)
    # a VM of its own: an instrument cannot be taken off again, and would slow every later run
    arguments = [*session.prepare_inputs(feeds), *session.weights]
    profiled_vm = relax.VirtualMachine(session.executable, session.device)
    profiled_vm.set_instrument(instrument)
    profiled_vm[_interpreted_main(profiled_vm)](*arguments)
    in_run, instrumented_run_seconds = _in_run_seconds(session, kernels_module, arguments)
    for site, seconds in in_run.items():
        if site in call_sites:  # a call in a branch the profiled run did not take has no row
            call_sites[site].in_run_seconds = seconds
    for site in call_sites.values():
        site.calls = calls_of[site.name]
    run_seconds = float(np.median(session.time_run(feeds, repeat=max(20, repeat))))
    return Profile(sorted(call_sites.values(), key=lambda k: -k.in_run_seconds), run_seconds,
                   instrumented_run_seconds)



def _in_run_seconds(session, kernels_module, arguments: list
                    ) -> tuple[dict[tuple[str, int], float], float]:
    """Each call site's time inside whole runs, and the time of those whole runs: medians over
    IN_RUN_RUNS runs."""
    runs: list[dict[tuple[str, int], float]] = []
    run_seconds: list[float] = []
    started: dict[str, float] = {}
    calls_of: Counter[str] = Counter()

    def instrument(func, symbol, before_run, return_value, *call_arguments):
        if kernels_module.implements_function(symbol):
            now = time.perf_counter()
            if before_run:
                started[symbol] = now
            else:
                calls_of[symbol] += 1
                runs[-1][symbol, calls_of[symbol]] = now - started[symbol]
        return 0  # VMInstrumentReturnKind.NO_OP

    timed_vm = relax.VirtualMachine(session.executable, session.device)
    timed_vm.set_instrument(instrument)
    main = _interpreted_main(timed_vm)
    for _ in range(IN_RUN_RUNS):
        runs.append({})
        calls_of.clear()
        run_started = time.perf_counter()
        timed_vm[main](*arguments)
        run_seconds.append(time.perf_counter() - run_started)
    # a call that runs in some runs only (an If branch) counts 0 in the others
    sites = {site for run in runs for site in run}
    medians = {site: float(np.median([run.get(site, 0.0) for run in runs])) for site in sites}
    return medians, float(np.median(run_seconds))


def _interpreted_main(vm: relax.VirtualMachine) -> str:
    """The bytecode copy of "main", whose kernel calls an instrument sees (vm_code.py); "main"
    itself in packages built before the copy existed, which ran bytecode only."""
    try:
        vm[interpreted("main")]
    except AttributeError:
        return "main"
    return interpreted("main")


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
