"""Element-wise math where TVM's converters and ONNX disagree (ops_math.py): BitShift by any
amount, against ONNX's rule that a shift by a negative amount or one of at least the type's
width moves every bit out; IsInf of one infinity only; Elu and Celu in float16 as in float32."""

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import tightfit
from tightfit.feeds import run_onnxruntime

DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]


@functools.cache
def shift_session(dtype: str, direction: str):
    """x << s or x >> s over a symbolic length, x and s of `dtype` (ONNX's one type T)."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(
        [helper.make_node("BitShift", ["x", "s"], ["y"], direction=direction)], "g",
        [helper.make_tensor_value_info(name, elem, ["n"]) for name in ("x", "s")],
        [helper.make_tensor_value_info("y", elem, ["n"])])
    return tightfit.compile(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])).session()


def onnx_shift(x: int, s: int, dtype: str, direction: str) -> int:
    info = np.iinfo(dtype)
    bits = info.bits
    if direction == "RIGHT":
        return x >> s if 0 <= s < bits else (-1 if x < 0 else 0)  # Python's >> keeps the sign
    if not 0 <= s < bits:
        return 0
    wrapped = (x << s) & ((1 << bits) - 1)
    return wrapped - (1 << bits) if info.min < 0 and wrapped > info.max else wrapped


@st.composite
def shift_cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    info = np.iinfo(dtype)
    n = draw(st.integers(1, 12))
    values = draw(st.lists(st.integers(int(info.min), int(info.max)), min_size=n, max_size=n))
    # amounts in range, on both edges of it, and far outside (negative ones where T is signed)
    amounts = st.one_of(st.integers(0, info.bits - 1), st.sampled_from([info.bits - 1, info.bits]),
                        st.integers(max(int(info.min), -200), min(int(info.max), 200)))
    shifts = draw(st.lists(amounts, min_size=n, max_size=n))
    return dtype, draw(st.sampled_from(["LEFT", "RIGHT"])), values, shifts


@settings(max_examples=60, deadline=None)
@given(shift_cases())
def test_bitshift_by_any_amount_gives_onnx_result(case):
    dtype, direction, values, shifts = case
    x, s = np.array(values, dtype), np.array(shifts, dtype)
    result = shift_session(dtype, direction).run({"x": x, "s": s})["y"]
    expected = np.array([onnx_shift(int(a), int(b), dtype, direction) for a, b in zip(x, s)], dtype)
    assert result.dtype == expected.dtype
    np.testing.assert_array_equal(result, expected, err_msg=f"{dtype} {direction} x={x} s={s}")


@pytest.mark.parametrize("negative, positive", [(1, 1), (1, 0), (0, 1), (0, 0)])
def test_isinf_flags_the_infinities_its_attributes_ask_for(negative, positive):
    graph = helper.make_graph(
        [helper.make_node("IsInf", ["x"], ["y"], detect_negative=negative, detect_positive=positive)],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.BOOL, ["n"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.array([-np.inf, -1.0, 0.0, np.nan, 2.5, np.inf], np.float32)
    np.testing.assert_array_equal(tightfit.compile(model).session().run({"x": x})["y"],
                                  run_onnxruntime(model, {"x": x})["y"])


# ONNX's Celu takes float32 only (its function body, an Elu, any float type)
@pytest.mark.parametrize("op,alpha,dtype", [("Elu", 0.7, np.float32), ("Elu", 0.7, np.float16),
                                            ("Celu", 1.6, np.float32)])
def test_elu_and_celu_in_the_input_type_match_onnxruntime(op, alpha, dtype):
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph([helper.make_node(op, ["x"], ["y"], alpha=alpha)], "g",
                              [helper.make_tensor_value_info("x", elem, ["n"])],
                              [helper.make_tensor_value_info("y", elem, ["n"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    x = np.linspace(-6, 6, 49).astype(dtype)
    ours = tightfit.compile(model).session().run({"x": x})["y"]
    assert ours.dtype == dtype
    tolerance = 1e-3 if dtype == np.float16 else 1e-6
    np.testing.assert_allclose(ours, run_onnxruntime(model, {"x": x})["y"], rtol=tolerance, atol=tolerance)
