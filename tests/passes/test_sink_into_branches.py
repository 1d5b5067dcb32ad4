"""SinkIntoBranches: what only one branch of an If uses is computed in that branch."""

import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import tightfit
from tightfit.feeds import run_onnxruntime
from tightfit.passes import SinkIntoBranches
from tightfit.profiling import _kernel_library
from tightfit.testing import zoo
from tightfit.vm_code import interpreted


def test_chains_used_by_one_branch_move_into_it_and_shared_values_stay():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4,), "float32"), gate: R.Tensor((), "bool")):
            doubled = R.add(x, x)
            squared = R.multiply(doubled, doubled)
            shared = R.exp(x)
            zeros = R.subtract(x, x)
            if gate:
                picked = R.add(squared, shared)
            else:
                picked = R.add(zeros, shared)
            out = R.add(picked, x)
            return out

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4,), "float32"), gate: R.Tensor((), "bool")):
            shared = R.exp(x)
            if gate:
                doubled = R.add(x, x)
                squared = R.multiply(doubled, doubled)
                picked = R.add(squared, shared)
            else:
                zeros = R.subtract(x, x)
                picked = R.add(zeros, shared)
            out = R.add(picked, x)
            return out

    tvm.ir.assert_structural_equal(SinkIntoBranches()(Before), Expected)


def test_nested_gates_get_their_own_chains_and_the_condition_and_later_uses_stay():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4,), "float32"), outer: R.Tensor((), "bool"),
                 inner: R.Tensor((), "bool")):
            inner_only = R.exp(x)
            outer_only = R.add(x, x)
            also_after = R.multiply(x, x)
            if outer:
                if inner:
                    deep = R.add(inner_only, outer_only)
                else:
                    deep = R.add(outer_only, also_after)
                picked = deep
            else:
                picked = x
            out = R.add(picked, also_after)
            return out

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4,), "float32"), outer: R.Tensor((), "bool"),
                 inner: R.Tensor((), "bool")):
            also_after = R.multiply(x, x)
            if outer:
                outer_only = R.add(x, x)
                if inner:
                    inner_only = R.exp(x)
                    deep = R.add(inner_only, outer_only)
                else:
                    deep = R.add(outer_only, also_after)
                picked = deep
            else:
                picked = x
            out = R.add(picked, also_after)
            return out

    tvm.ir.assert_structural_equal(SinkIntoBranches()(Before), Expected)


def test_impure_calls_stay_where_they_run():
    @I.ir_module
    class Before:
        @R.function(pure=False)
        def main(x: R.Tensor((4,), "float32"), gate: R.Tensor((), "bool")):
            logged = R.call_packed("log_and_copy", x, ty_args=R.Tensor((4,), "float32"))
            if gate:
                picked = R.add(x, x)
            else:
                picked = R.add(logged, x)
            return picked

    assert SinkIntoBranches()(Before).script() == Before.script()


def test_a_gate_that_skips_its_conv_runs_no_conv_and_both_paths_match_onnxruntime():
    model_spec = zoo.get("gated_skip_block")
    model = model_spec.build()
    session = tightfit.compile(model).session()
    kernels = _kernel_library(session.executable)
    for shapes in model_spec.shape_sets:  # even batches take the conv branch, odd ones skip it
        feeds = model_spec.feeds(shapes)
        called = []

        def record(func, symbol, before_run, ret, *args):
            if before_run and kernels.implements_function(symbol):
                called.append(symbol)
            return 0

        vm = relax.VirtualMachine(session.executable, session.device)
        vm.set_instrument(record)
        # the bytecode copy of main: native code calls its kernels where no instrument sees
        vm[interpreted("main")](*session.prepare_inputs(feeds), *session.weights)
        takes_conv = shapes["x"][0] % 2 == 0
        assert any("conv2d" in symbol for symbol in called) == takes_conv, called
        np.testing.assert_allclose(session.run(feeds)["y"], run_onnxruntime(model, feeds)["y"],
                                   rtol=1e-4, atol=1e-5)
