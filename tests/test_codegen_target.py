"""Code generation reassociates float additions only with fast_math, and never against the target's own setting."""

from dataclasses import replace

import pytest

from tightfit.pipeline import PipelineOptions, codegen_target
from tightfit.target import resolve_target


def test_fast_math_lets_llvm_reassociate_float_additions():
    target = codegen_target(resolve_target("host"), PipelineOptions())
    assert bool(target.attrs["fast-math-reassoc"])
    assert target.attrs["mcpu"] == resolve_target("host").tvm_target.attrs["mcpu"]


def test_without_fast_math_the_target_is_left_as_it_is():
    host = resolve_target("host")
    assert codegen_target(host, replace(PipelineOptions(), fast_math=False)).same_as(host.tvm_target)


@pytest.mark.parametrize("setting", [False, True])
def test_a_target_that_sets_reassociation_itself_keeps_its_setting(setting):
    target = resolve_target({"kind": "llvm", "fast-math-reassoc": setting})
    assert bool(codegen_target(target, PipelineOptions()).attrs["fast-math-reassoc"]) is setting
