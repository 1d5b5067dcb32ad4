"""NonZero runs as compiled kernels (count, scan, unravel), not as TVM's Python callback."""

from functools import cache

import numpy as np
import onnxruntime
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import tightfit

DTYPES = {"float32": TensorProto.FLOAT, "int64": TensorProto.INT64, "bool": TensorProto.BOOL}


def nonzero_model(dtype: str, rank: int):
    dims = [f"d{axis}" for axis in range(rank)]
    graph = helper.make_graph(
        [helper.make_node("NonZero", ["x"], ["indices"])], "nonzero",
        [helper.make_tensor_value_info("x", DTYPES[dtype], dims)],
        [helper.make_tensor_value_info("indices", TensorProto.INT64, [rank, "count"])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@cache
def nonzero_package(dtype: str, rank: int):
    return tightfit.compile(nonzero_model(dtype, rank))


@settings(max_examples=30, deadline=None, database=None)
@given(dtype=st.sampled_from(sorted(DTYPES)), shape=st.lists(st.integers(0, 5), min_size=1, max_size=3),
       density=st.sampled_from([0.0, 0.3, 1.0]), seed=st.integers(0, 2**16))
def test_nonzero_matches_onnxruntime_for_any_shape_dtype_and_density(dtype, shape, density, seed):
    rng = np.random.default_rng(seed)
    x = (rng.random(shape) < density) * rng.integers(1, 9, shape)
    x = x.astype(dtype)
    expected = onnxruntime.InferenceSession(nonzero_model(dtype, len(shape)).SerializeToString()).run(None, {"x": x})[0]
    got = nonzero_package(dtype, len(shape)).session().run({"x": x})["indices"]
    assert got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)


def test_no_python_callback_remains(tmp_path):
    tightfit.compile(nonzero_model("float32", 2), dump_ir=tmp_path)
    lowered = sorted(tmp_path.iterdir())[-1].read_text()
    assert "relax.run.nonzero" not in lowered and "R.nonzero" not in lowered
    assert "nonzero_positions" in lowered
