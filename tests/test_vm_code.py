"""A package runs its model as native VM code and keeps a bytecode copy for the profiler."""

import numpy as np
import tvm
from tvm import relax

import tightfit
from tightfit.feeds import run_onnxruntime
from tightfit.profiling import _kernel_library
from tightfit.session import _flatten
from tightfit.testing import zoo
from tightfit.vm_code import interpreted


def _kernel_calls_seen(vm: relax.VirtualMachine, library, function: str, arguments) -> list[str]:
    seen = []

    def instrument(func, symbol, before_run, return_value, *call_arguments):
        if before_run and library.implements_function(symbol):
            seen.append(symbol)
        return 0  # VMInstrumentReturnKind.NO_OP

    vm.set_instrument(instrument)
    vm[function](*arguments)
    return seen


def test_native_main_and_its_bytecode_copy_agree_with_onnxruntime_on_both_branches(tmp_path):
    entry = zoo.get("gated_skip_block")  # an If on a data-dependent gate
    model = entry.build()
    saved = tightfit.compile(model).save(tmp_path / "gated.tfpkg")
    package = tightfit.load(saved)
    session = package.session()
    library = _kernel_library(session.executable)
    for shapes in entry.shape_sets:  # the shape sets take both branches
        feeds = entry.feeds(shapes)
        expected = run_onnxruntime(model, feeds)
        arguments = [*session.prepare_inputs(feeds), *session.weights]
        outputs = {}
        for function in ("main", interpreted("main")):
            vm = relax.VirtualMachine(session.executable, tvm.cpu())
            kernels = _kernel_calls_seen(vm, library, function, arguments)
            # native code calls its kernels directly: only the bytecode's calls pass the VM
            assert bool(kernels) == (function != "main")
            outputs[function] = vm[function](*arguments)
        native, bytecode = ([value.numpy() for value in _flatten(outputs[f])]
                            for f in ("main", interpreted("main")))
        assert len(native) == len(bytecode) == len(expected)
        for name, want, got, again in zip(expected, expected.values(), native, bytecode):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)
            np.testing.assert_array_equal(again, got)

