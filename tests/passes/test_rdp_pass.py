"""RankDimensionPropagation rewrites what it proves into the IR: tiny modules in, expected out.

Each test writes the input and the expected module in TVMScript (RDP's text attributes are
compared separately, where they matter). Soundness at run time is test_rdp_soundness.py's job.
"""

import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tightfit.passes import ClassifyDynamism, RankDimensionPropagation
from tightfit.passes.rdp import EQUALITIES_ATTR, FACTS_ATTR, analyze_module

RDP_ATTRS = (FACTS_ATTR, EQUALITIES_ATTR, "tightfit.dynamism", "tightfit.rdp_converged")


def rdp(mod: tvm.IRModule) -> tvm.IRModule:
    return RankDimensionPropagation()(ClassifyDynamism()(mod))


def without_rdp_attrs(mod: tvm.IRModule) -> tvm.IRModule:
    result = mod.clone()
    func = result["main"]
    for key in RDP_ATTRS:
        func = func.without_attr(key)
    result["main"] = func
    return result


def assert_rewritten(before: tvm.IRModule, expected: tvm.IRModule) -> tvm.IRModule:
    after = rdp(before)
    tvm.ir.assert_structural_equal(without_rdp_attrs(after), expected)
    return after


def test_matmul_ties_a_nonzero_count_to_an_input_dim_and_the_match_cast_becomes_a_check():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("rows", 4), "float32"), v: R.Tensor(("rows", 8), "float32")):
            count = T.int64()
            with R.dataflow():
                sums = R.sum(x, axis=[1])
                positive = R.greater(sums, R.const(0.0))
                found = R.nonzero(positive)
                positions = R.match_cast(found, R.Tensor((1, count), "int64"))
                index = R.squeeze(positions, axis=[0])
                kept = R.take(x, index, axis=0)
                kept_t = R.permute_dims(kept, [1, 0])
                mixed = R.matmul(kept_t, v)
                R.output(mixed)
            return mixed

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor(("rows", 4), "float32"), v: R.Tensor(("rows", 8), "float32")):
            rows = T.int64()
            with R.dataflow():
                sums = R.sum(x, axis=[1])
                positive = R.greater(sums, R.const(0.0))
                found = R.nonzero(positive)
                positions = R.match_cast(found, R.Tensor((1, rows), "int64"))
                index = R.squeeze(positions, axis=[0])
                kept = R.take(x, index, axis=0)
                kept_t = R.permute_dims(kept, [1, 0])
                mixed = R.matmul(kept_t, v)
                R.output(mixed)
            return mixed

    after = assert_rewritten(Before, Expected)
    assert list(after["main"].attrs[EQUALITIES_ATTR]) == ["count == rows"]
    assert after["main"].attrs[FACTS_ATTR]["found"] == "(1, rows)"


def test_broadcast_against_a_dim_that_cannot_be_one_gives_that_dim():
    @I.ir_module
    class Before:
        @R.function
        def main(a: R.Tensor(("n", 16), "float32"), b: R.Tensor((5, 16), "float32")):
            with R.dataflow():
                c = R.add(a, b)  # Relax: ndim=2 (it cannot tell n from 5)
                d = R.nn.relu(c)
                R.output(d)
            return d

    @I.ir_module
    class Expected:
        @R.function
        def main(a: R.Tensor(("n", 16), "float32"), b: R.Tensor((5, 16), "float32")) -> R.Tensor((5, 16), "float32"):
            with R.dataflow():
                c = R.add(a, b)
                c_rdp = R.match_cast(c, R.Tensor((5, 16), "float32"))
                d = R.nn.relu(c_rdp)
                R.output(d)
            return d

    assert_rewritten(Before, Expected)


def test_shape_values_computed_by_tensor_arithmetic_solve_the_reshape_symbols():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("b", "s", 16), "float32")):
            r = T.int64()
            c = T.int64()
            with R.dataflow():
                dims = R.shape_to_tensor(R.shape_of(x))
                first = R.take(dims, R.const(0, "int64"), axis=0)
                second = R.take(dims, R.const(1, "int64"), axis=0)
                rows = R.reshape(R.multiply(first, second), R.shape([1]))
                target = R.concat((rows, R.const([16], "int64")), axis=0)
                shape = R.tensor_to_shape(target)
                named = R.match_cast(shape, R.Shape([r, c]))
                flat = R.reshape(x, named)
                R.output(flat)
            return flat

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor(("b", "s", 16), "float32")) -> R.Tensor(("b * s", 16), "float32"):
            b = T.int64()
            s = T.int64()
            with R.dataflow():
                lv = R.shape_of(x)
                dims = R.shape_to_tensor(lv)
                first = R.take(dims, R.const(0, "int64"), axis=0)
                second = R.take(dims, R.const(1, "int64"), axis=0)
                lv4 = R.multiply(first, second)
                rows = R.reshape(lv4, R.shape([1]))
                target = R.concat((rows, R.const([16], "int64")), axis=0)
                shape = R.tensor_to_shape(target)
                named = R.match_cast(shape, R.Shape([b * s, 16]))
                flat = R.reshape(x, named)
                R.output(flat)
            return flat

    after = assert_rewritten(Before, Expected)
    classes = after["main"].attrs["tightfit.dynamism"]
    assert classes["flat"] == "ISDOS"  # was ISVDOS: RDP knows the value of its shape argument


def test_a_call_whose_value_rdp_knows_is_bound_to_that_constant():
    """An attention scale from a static dim of a dynamic shape: the take becomes its constant,
    so the calls after it fold (FoldConstantCalls) instead of running as kernels; the shape
    tensor, whose first element is only known as a symbol, stays a call."""
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("n", 8), "float32")):
            with R.dataflow():
                dims = R.shape_to_tensor(R.shape_of(x))
                width = R.take(dims, R.const(1, "int64"), axis=0)
                scale = R.astype(width, "float32")
                y = R.divide(x, scale)
                R.output(y)
            return y

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor(("n", 8), "float32")) -> R.Tensor(("n", 8), "float32"):
            n = T.int64()
            with R.dataflow():
                lv = R.shape_of(x)
                dims = R.shape_to_tensor(lv)
                width = R.const(8, "int64")
                scale = R.astype(width, "float32")
                y = R.divide(x, scale)
                R.output(y)
            return y

    assert_rewritten(Before, Expected)


def test_concat_and_matmul_pass_a_length_back_to_a_nonzero_count():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("n",), "float32"), v: R.Tensor(("m", 8), "float32")):
            count = T.int64()
            with R.dataflow():
                positive = R.greater(x, R.const(0.0))
                found = R.nonzero(positive)
                positions = R.match_cast(found, R.Tensor((1, count), "int64"))
                index = R.squeeze(positions, axis=[0])
                picked = R.take(x, index, axis=0)
                column = R.reshape(picked, R.shape([count, 1]))
                rows = R.broadcast_to(column, R.shape([count, 4]))
                padded = R.concat((rows, R.zeros(R.shape([3, 4]), "float32")), axis=0)
                padded_t = R.permute_dims(padded, [1, 0])
                mixed = R.matmul(padded_t, v)  # needs count + 3 == m
                R.output(mixed)
            return mixed

    result = analyze_module(ClassifyDynamism()(Before))
    facts = result.described()
    assert facts["positions"] == "(1, m - 3)"
    assert facts["padded"] == "(m, 4)"


def test_if_branches_of_different_widths_merge_to_nac_and_the_join_gets_a_fresh_symbol():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("b", 6), "float32"), flag: R.Tensor((), "bool")):
            if flag:
                kept = R.sum(x, axis=[1], keepdims=True)
                y = kept
            else:
                sliced = R.strided_slice(x, axes=[1], begin=[0], end=[2])
                y = sliced
            z = R.nn.relu(y)
            return z

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor(("b", 6), "float32"), flag: R.Tensor((), "bool")) -> R.Tensor(ndim=2, dtype="float32"):
            b = T.int64()
            y_d1 = T.int64()
            if flag:
                kept = R.sum(x, axis=[1], keepdims=True)
                y = kept
            else:
                sliced = R.strided_slice(x, axes=[1], begin=[0], end=[2])
                y = sliced
            y_rdp = R.match_cast(y, R.Tensor((b, y_d1), "float32"))
            z = R.nn.relu(y_rdp)
            return z

    after = assert_rewritten(Before, Expected)
    assert after["main"].attrs[FACTS_ATTR]["y"] == "(b, nac)"


def test_if_branches_of_the_same_symbolic_shape_merge_to_it():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("b", 6), "float32"), flag: R.Tensor((), "bool")):
            b = T.int64()
            n = T.int64()
            if flag:
                doubled = R.reshape(x, R.shape([b * 2, 3]))
                loose = R.match_cast(doubled, R.Tensor(ndim=2, dtype="float32"))
                y = loose
            else:
                halves = R.reshape(x, R.shape([b * 2, 3]))
                y = halves
            named = R.match_cast(y, R.Tensor((n, 3), "float32"))
            return named

    result = analyze_module(ClassifyDynamism()(Before))
    assert result.described()["y"] == "(b * 2, 3)"
    assert result.equalities() == ["n == b * 2"]


def test_a_fact_that_holds_in_one_branch_solves_no_symbol_bound_after_the_join():
    # then: (b, 1); else: (b, 2). After the join `w` names the width; only on the then path is
    # it 1, so RDP must not substitute 1 for it (an unsound version once did)
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("b", 6), "float32"), flag: R.Tensor((), "bool")):
            h = T.int64()
            w = T.int64()
            if flag:
                kept = R.sum(x, axis=[1], keepdims=True)
                loose_then = R.match_cast(kept, R.Tensor(ndim=2, dtype="float32"))
                y = loose_then
            else:
                sliced = R.strided_slice(x, axes=[1], begin=[0], end=[2])
                loose_else = R.match_cast(sliced, R.Tensor(ndim=2, dtype="float32"))
                y = loose_else
            named = R.match_cast(y, R.Tensor((h, w), "float32"))
            return named

    result = analyze_module(ClassifyDynamism()(Before))
    assert result.equalities() == ["h == b"]
    assert result.described()["named"] == "(b, nac(w))"


def test_reshape_with_a_known_output_solves_its_one_unknown_input_dim():
    @I.ir_module
    class Before:
        @R.function
        def main(mask: R.Tensor(("n", 3), "bool")):
            n = T.int64()
            count = T.int64()
            with R.dataflow():
                found = R.nonzero(mask)
                positions = R.match_cast(found, R.Tensor((2, count), "int64"))
                flat = R.reshape(positions, R.shape([n * 2]))  # valid only if count == n
                R.output(flat)
            return flat

    result = analyze_module(ClassifyDynamism()(Before))
    assert result.equalities() == ["count == n"]
    assert result.described()["found"] == "(2, n)"


def test_printed_module_keeps_the_analysis_and_runs_through_rdp_again():
    @I.ir_module
    class Before:
        @R.function
        def main(a: R.Tensor(("n", 16), "float32"), b: R.Tensor((5, 16), "float32")):
            with R.dataflow():
                c = R.add(a, b)
                R.output(c)
            return c

    after = rdp(Before)
    reparsed = tvm.script.from_source(after.script())
    tvm.ir.assert_structural_equal(reparsed, after)
    assert reparsed["main"].attrs[FACTS_ATTR]["c"] == "(5, 16)"
    tvm.ir.assert_structural_equal(without_rdp_attrs(rdp(reparsed)), without_rdp_attrs(after))
