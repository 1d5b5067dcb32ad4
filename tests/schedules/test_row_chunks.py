"""Rows of a symbolic width in vector chunks (schedules/row_chunks.py): the steps cover every
element once, and the steps that can never run are left out of the kernel."""

import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import tirx

from tightfit.frontend import import_onnx
from tightfit.pipeline import run_pipeline
from tightfit.schedules.row_chunks import chunk_steps, element_steps, narrowest_chunk, substitute
from tightfit.target import resolve_target

from kernel_harness import AVX512_TARGET
from test_direct_depthwise import WINDOWS, depthwise_model

LANES = 16


def _covered_elements(width: tirx.Var, value: int, prove=None) -> list[int]:
    """The elements the chunk and element steps over a row of `width` write where it is
    `value`, found by walking the steps as code would run them."""
    written: list[int] = []

    def chunk(offset, count):
        return tirx.Evaluate(tirx.call_extern("int32", "chunk", offset, count))

    def element(offset):
        return chunk(offset, 1)

    chunks, covered = chunk_steps(width, LANES, "int64", chunk, prove)
    steps = chunks + element_steps(covered, width, narrowest_chunk(LANES) - 1, element, prove)

    def run(stmt, values: dict):
        if isinstance(stmt, tirx.For):
            for k in range(int(substitute(stmt.extent, values))):
                run(stmt.body, {**values, stmt.loop_var: tirx.const(k, "int64")})
        elif isinstance(stmt, tirx.IfThenElse):
            if bool(substitute(stmt.condition, values)):
                run(stmt.then_case, values)
        else:
            offset, count = (int(substitute(arg, values)) for arg in stmt.value.args[1:])
            written.extend(range(offset, offset + count))

    for step in steps:
        run(step, {width: tirx.const(value, "int64")})
    return written


@given(value=st.integers(0, 80))
@settings(max_examples=40, deadline=None)
def test_the_steps_write_each_element_of_a_symbolic_row_once(value):
    width = tirx.Var("w", "int64")
    assert _covered_elements(width, value) == list(range(value))


@pytest.mark.parametrize("bound", [3, 4, 15, 16, 17])
def test_steps_a_bound_rules_out_are_left_out(bound):
    """Under `w < bound` (a kernel version's condition) the whole-vector loop is gone where no
    row reaches a vector (kept at 17), and so is every chunk no narrower than the bound; the
    steps left still write each element once."""
    width = tirx.Var("w", "int64")
    analyzer = tvm.sym.Analyzer()

    def prove(condition):
        with analyzer.constraint_scope(tirx.And(width >= 0, width < bound)):
            return analyzer.can_prove(condition)

    def nothing(offset, count=1):
        return tirx.Evaluate(0)

    chunks, covered = chunk_steps(width, LANES, "int64", nothing, prove)
    loops = [step for step in chunks if isinstance(step, tirx.For)]
    assert (len(loops) == 1) == (bound > LANES)
    narrower_chunks = [step for step in chunks if isinstance(step, tirx.IfThenElse)]
    assert len(narrower_chunks) == sum(1 for count in (8, 4) if count < bound)
    for value in range(bound):
        assert _covered_elements(width, value, prove) == list(range(value))


def test_a_packed_row_of_an_odd_width_remainder_has_no_dead_steps_nor_mins():
    """A stride-2 depthwise conv packs each row's padding and phases in chunk steps; those over
    spans the analyzer bounds (a width's remainder by the stride) used to stay in the kernel as
    empty loops and `if`s that never hold, each lowered by TVM's passes like the rest. The
    phases' ends are known by the width's parity: no min() of them in the row's indices, which
    TVM's passes simplify once per index."""
    scheduled, _ = run_pipeline(import_onnx(depthwise_model(*WINDOWS[0])).mod,
                                resolve_target(AVX512_TARGET), stop_after="tightfit.ScheduleKernels")
    kernel = next(func.script() for global_var, func in scheduled.functions.items()
                  if "depthwise" in global_var.name_hint)
    assert "depthwise_input_phases" in kernel
    assert "range(T.int64(0))" not in kernel and "T.bool(False)" not in kernel
    assert not any(f"% T.int64(2) // T.int64({lanes})" in kernel for lanes in (8, 16))
    packing = [line for line in kernel.splitlines() if "depthwise_input_phases_row[" in line]
    assert packing and not any("T.min" in line for line in packing)
