"""RDP's dim checks on tensors become checks on shape values, made as soon as the dims are
known, so that the checked tensor does not end a kernel sequence."""

import numpy as np
import pytest
import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import tightfit
from tightfit.errors import InputError
from tightfit.feeds import run_onnxruntime
from tightfit.passes import CheckDimsOnShapes
from tightfit.testing import zoo


def test_a_check_moves_to_where_its_dims_are_known_and_one_proven_needs_none():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("n", 4), "float32"), count: R.Tensor((1,), "int64")):
            n = T.int64()
            k = T.int64()
            doubled = R.add(x, x)
            shape = R.tensor_to_shape(count)
            count_shape = R.match_cast(shape, R.Shape([k]))
            kept = R.zeros(R.shape([k, 4]), "float32")
            tied = R.match_cast(kept, R.Tensor((n, 4), "float32"))
            same = R.match_cast(doubled, R.Tensor((n, 4), "float32"))
            return (tied, same)

    # In TVMScript a var bound to another gets that one's type; here the tensor keeps the
    # type its check established, so the result is compared binding by binding.
    bindings = CheckDimsOnShapes()(Before)["main"].body.blocks[0].bindings
    assert [(binding.var.name, type(binding).__name__, str(binding.value), str(binding.var.ty))
            for binding in bindings] == [
        ("doubled", "VarBinding", "R.add(x, x)", 'R.Tensor((n, 4), dtype="float32")'),
        ("shape", "VarBinding", "R.tensor_to_shape(count)", "R.Shape(ndim=1)"),
        ("count_shape", "MatchCast", "shape", "R.Shape([k])"),
        ("tied_dims", "VarBinding", "R.shape([k, 4])", "R.Shape([k, 4])"),
        ("tied_checked_dims", "MatchCast", "tied_dims", "R.Shape([n, 4])"),
        ("kept", "VarBinding", 'R.zeros(R.shape([k, 4]), dtype="float32")', 'R.Tensor((k, 4), dtype="float32")'),
        ("tied", "VarBinding", "kept", 'R.Tensor((n, 4), dtype="float32")'),
        ("same", "VarBinding", "doubled", 'R.Tensor((n, 4), dtype="float32")'),
    ]


def test_a_match_cast_that_defines_a_dim_is_left_alone():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("n", 4), "float32")):
            m = T.int64()
            doubled = R.add(x, x)
            renamed = R.match_cast(doubled, R.Tensor((m, 4), "float32"))
            return renamed

    tvm.ir.assert_structural_equal(CheckDimsOnShapes()(Before), Before)


def test_checks_in_a_branch_use_the_dims_known_outside_it():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("n", 4), "float32"), flag: R.Tensor((), "bool")):
            n = T.int64()
            k = T.int64()
            if flag:
                kept = R.zeros(R.shape([2 * n, 4]), "float32")
                halves = R.reshape(kept, R.shape([n, 8]))
                tied = R.match_cast(kept, R.Tensor((n + n, 4), "float32"))
                out = R.match_cast(halves, R.Tensor((k, 8), "float32"))
            else:
                out = R.zeros(R.shape([n, 8]), "float32")
            return out

    after = CheckDimsOnShapes()(Before)
    branch = after["main"].body.blocks[0].bindings[0].value.true_branch.blocks[0].bindings
    # 2 * n and n + n are proven equal: no check; the cast defining k stays
    assert [type(binding).__name__ for binding in branch] == [
        "VarBinding", "VarBinding", "VarBinding", "MatchCast"]


@pytest.mark.parametrize("name, sequences", [("nonzero_rows_tied", 2), ("speech_encoder_dynamo", 1)])
def test_a_checked_tensor_no_longer_ends_a_kernel_sequence(name, sequences):
    """nonzero_rows_tied checks NonZero's count against the rows it multiplies (three sequences
    before: the count's, the positions', the rest's; the count is still read back between two,
    for the output of `count` rows); speech_encoder_dynamo checks `T.Div(time - 1, 4) + 1`
    frames against `(time - 1) // 4 + 1` twice (three sequences before)."""
    entry = zoo.get(name)
    package = tightfit.compile(entry.build())
    assert len(package.report["kernel_sequences"]) == sequences


def test_a_failing_check_raises_an_input_error_before_the_kernels_that_rely_on_it():
    """A NaN row drops out of nonzero_rows_tied's count, which then no longer matches the rows
    of `v` its MatMul multiplies (onnxruntime fails too)."""
    model = zoo.get("nonzero_rows_tied").build()
    session = tightfit.compile(model).session()
    rng = np.random.default_rng(0)
    for rows in (1, 3, 7):
        feeds = {"x": rng.standard_normal((rows, 4)).astype(np.float32),
                 "v": rng.standard_normal((rows, 8)).astype(np.float32)}
        expected = run_onnxruntime(model, feeds)
        for name, value in session.run(feeds).items():
            np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-5)
    feeds["x"][1, 2] = np.nan
    with pytest.raises(InputError, match=r"axis 1 of a tensor is 6 where the graph needs 7"):
        session.run(feeds)
