"""What RDP should prove on the `rdp_models` cases, beyond what Relax's own inference knows.

Soundness (test_rdp_soundness.py) says RDP never claims a wrong shape; these say it claims the
right ones where the issue asks for them: backward propagation through MatMul, Merge at If joins,
shape values carried through tensor arithmetic. A case RDP does not prove yet is marked
`xfail(strict=True)` with the reason, so that fixing it turns the marker into a failure to remove.
"""

from tvm import tirx

import rdp_models
from predictions import evaluate
from test_shape_probe import normalized
from tightfit.passes.rdp import analyze_module
from tightfit.passes.rdp_lattice import NAC, UNDEF

NAC_DIM = "nac"


def rdp_dims(model, output: int = 0):
    """RDP's dims for the model's `output`-th output, and its input symbols by name."""
    result = analyze_module(normalized(model))
    symbols = {var.name: var for var in result.symbols.inputs}
    returned = result.func.body.body
    fact = result.facts[returned]
    if fact.kind == "tuple":
        fact = fact.fields[output]
    return [None if d is NAC or d is UNDEF else result.symbols.normalize(d) for d in fact.dims], \
        symbols, result


def assert_dims(dims, expected, result):
    assert len(dims) == len(expected)
    for dim, want in zip(dims, expected):
        if isinstance(want, str):
            assert dim is None or result.symbols.needs_cut(dim), f"{dim} should be nac"
        else:
            assert dim is not None and not result.symbols.needs_cut(dim), f"{dim} should be {want}"
            assert result.symbols.equal(dim, want), f"{dim} != {want}"


def int64(value: int):
    return tirx.IntImm("int64", value)


def test_nonzero_count_tied_to_rows_by_matmul():
    # NonZero's count is data-dependent, but the MatMul it feeds needs it equal to `rows`
    dims, symbols, result = rdp_dims(rdp_models.nonzero_rows_tied(), output=1)
    assert_dims(dims, [symbols["rows"], int64(4)], result)


def test_if_with_different_branch_shapes_merges_to_nac():
    dims, symbols, result = rdp_dims(rdp_models.if_different_shapes())
    assert_dims(dims, [symbols["batch"], NAC_DIM], result)


def test_if_branches_of_the_same_symbolic_shape_merge_to_it():
    dims, symbols, result = rdp_dims(rdp_models.if_same_symbolic_shape())
    assert_dims(dims, [symbols["batch"] * int64(2), int64(3)], result)


def test_reshape_to_a_target_computed_from_the_shape():
    # [batch·seq / 2, int(float(16)·2)] then back to [batch, seq, -1]: the -1 is 4 only if RDP
    # carries integer and float arithmetic on shape values and solves the element count
    dims, symbols, result = rdp_dims(rdp_models.reshape_to_computed_shape())
    assert_dims(dims[:2], [symbols["batch"], symbols["seq"]], result)
    last = dims[2]  # an expression that is 4 wherever the model is valid (batch·seq even)
    assert last is not None and not result.symbols.needs_cut(last), f"{last} should be known"
    for batch, seq in [(1, 2), (3, 4), (2, 7)]:
        assert evaluate(last, {symbols["batch"]: batch, symbols["seq"]: seq}) == 4
