"""CumSum and CumProd run as one scan kernel over a [before, length, after] view of the tensor."""

from functools import cache

import numpy as np
import onnxruntime
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper
from tvm import relax
from tvm.script import relax as R

import tightfit
from tightfit.passes import LowerScans
from tightfit.passes.lower_scans import COLUMN_BLOCK

DTYPES = {"float32": TensorProto.FLOAT, "int32": TensorProto.INT32, "int64": TensorProto.INT64}


def cumsum_model(dtype: str, rank: int, axis: int, exclusive: int, reverse: int):
    dims = [f"d{d}" for d in range(rank)]
    graph = helper.make_graph(
        [helper.make_node("CumSum", ["x", "axis"], ["y"], exclusive=exclusive, reverse=reverse)], "cumsum",
        [helper.make_tensor_value_info("x", DTYPES[dtype], dims)],
        [helper.make_tensor_value_info("y", DTYPES[dtype], dims)],
        [helper.make_tensor("axis", TensorProto.INT64, [], [axis])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])


@cache
def cumsum_session(*key):
    return tightfit.compile(cumsum_model(*key)).session()


@settings(max_examples=25, deadline=None, database=None)
@given(dtype=st.sampled_from(sorted(DTYPES)), shape=st.lists(st.integers(0, 5), min_size=1, max_size=3),
       wide=st.booleans(), axis_draw=st.integers(0, 5), exclusive=st.integers(0, 1), reverse=st.integers(0, 1),
       seed=st.integers(0, 2**16))
def test_cumsum_matches_onnxruntime_for_any_shape_axis_and_mode(dtype, shape, wide, axis_draw, exclusive,
                                                                  reverse, seed):
    if wide:  # more columns after the axis than one task scans
        shape = [*shape, COLUMN_BLOCK + 3]
    axis = axis_draw % len(shape) - (len(shape) if axis_draw % 2 else 0)  # negative axes too
    rng = np.random.default_rng(seed)
    x = rng.integers(-9, 9, shape).astype(dtype)
    model = cumsum_model(dtype, len(shape), axis, exclusive, reverse)
    expected = onnxruntime.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    got = cumsum_session(dtype, len(shape), axis, exclusive, reverse).run({"x": x})["y"]
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-6)


@tvm.script.ir_module
class Scans:
    @R.function
    def main(x: R.Tensor(("a", "b", "c"), "int32")):
        product = R.cumprod(x, axis=1, exclusive=True)
        flat_sum = R.cumsum(x, axis=None, dtype="int64")
        return product, flat_sum


def test_products_and_flattening_scans_run_as_the_scan_kernel():
    lowered = LowerScans()(Scans)
    kernels = {gv.name_hint for gv, func in lowered.functions.items() if isinstance(func, tvm.tirx.PrimFunc)}
    assert kernels == {"cumprod", "cumsum"}
    assert "R.cumprod" not in lowered.script() and "R.cumsum" not in lowered.script()
    executable = tvm.compile(lowered, target="llvm")
    vm = relax.VirtualMachine(executable, tvm.cpu())
    x = np.random.default_rng(0).integers(1, 4, (2, 5, 3)).astype(np.int32)
    product, flat_sum = vm["main"](tvm.runtime.tensor(x))
    expected_product = np.concatenate([np.ones_like(x[:, :1]), np.cumprod(x, axis=1)[:, :-1]], axis=1)
    np.testing.assert_array_equal(product.numpy(), expected_product)
    assert flat_sum.numpy().dtype == np.int64
    np.testing.assert_array_equal(flat_sum.numpy(), np.cumsum(x.ravel(), dtype=np.int64))
