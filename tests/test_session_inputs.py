"""A session checks its inputs before running and says what the model expects."""

import numpy as np
import pytest

from tightfit.errors import InputError
from tightfit.frontend import TensorSpec
from tightfit.feeds import run_onnxruntime
from tightfit.session import check_feeds

SPECS = [TensorSpec("ids", ("batch", "seq"), "int64"), TensorSpec("mask", ("batch", "seq"), "float32"),
         TensorSpec("scale", (1,), "float32")]


def feeds(**overrides):
    base = {"ids": np.zeros((2, 5), np.int64), "mask": np.ones((2, 5), np.float32),
            "scale": np.ones((1,), np.float32)}
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


def test_matching_feeds_pass():
    check_feeds(SPECS, feeds())


@pytest.mark.parametrize("overrides, message", [
    ({"mask": None}, r"missing \['mask'\]"),
    ({"extra": np.zeros(1)}, r"unknown \['extra'\]"),
    ({"mask": np.ones((2, 5), np.float64)}, r"must be float32, got float64; convert it"),
    ({"ids": np.zeros((2, 5, 1), np.int64)}, r"must have rank 2"),
    ({"scale": np.ones((2,), np.float32)}, r"axis 0 is fixed at 1"),
    ({"mask": np.ones((2, 6), np.float32)}, r"dim seq is 5 at ids axis 1 but 6 at mask axis 1"),
    ({"ids": [[1, 2]]}, r"must be a numpy array"),
])
def test_wrong_feeds_name_the_problem(overrides, message):
    with pytest.raises(InputError, match=message):
        check_feeds(SPECS, feeds(**overrides))


def test_session_rejects_wrong_input_before_running(mlp_package):
    with pytest.raises(InputError, match="the model takes inputs"):
        mlp_package.session().run({"input": np.zeros((1, 8), np.float32)})


@pytest.mark.parametrize("wrong, message", [
    ({"x": np.zeros((3, 8), np.float64)}, "must be float32"),
    ({"x": np.zeros((3, 9), np.float32)}, "axis 1 is fixed at 8"),
    ({"x": np.zeros((3, 8), np.float32), "extra": np.zeros(1, np.float32)}, r"unknown \['extra'\]"),
    ({"x": [[0.0] * 8] * 3}, "must be a numpy array"),
])
def test_wrong_feeds_after_checked_ones_are_still_rejected(mlp_package, wrong, message):
    """Feeds like the last checked ones (names, dtypes, shapes) skip the full check; any other
    feeds still get it."""
    session = mlp_package.session()
    session.run({"x": np.zeros((3, 8), np.float32)})
    session.run({"x": np.ones((3, 8), np.float32)})
    with pytest.raises(InputError, match=message):
        session.run(wrong)


def _array(shape: tuple[int, ...], viewable: bool) -> np.ndarray:
    """An array TVM can view (contiguous), or one it cannot (every other row of a larger one),
    which the session copies into a staging buffer."""
    if viewable:
        return np.empty(shape, np.float32)
    return np.empty((2 * shape[0], *shape[1:]), np.float32)[::2]


@pytest.mark.parametrize("viewable", [True, False])
def test_an_array_fed_again_is_read_as_it_is_now(mlp_model, mlp_package, viewable):
    """The session places the arrays fed last as it did then (session._placed: the same view,
    or a copy into the same buffer): values written into an array since are what the next run
    reads, and another array is placed anew."""
    session = mlp_package.session()
    rng = np.random.default_rng(3)
    x, other = _array((3, 8), viewable), _array((3, 8), viewable)
    for array in (x, other):
        array[:] = rng.standard_normal((3, 8))
    for feeds in ({"x": x}, {"x": x}, {"x": other}, {"x": x}):
        np.testing.assert_allclose(session.run(feeds)["y"], run_onnxruntime(mlp_model, feeds)["y"],
                                   rtol=1e-5, atol=1e-5)
    x[:] = rng.standard_normal((3, 8))
    expected = run_onnxruntime(mlp_model, {"x": x})["y"]
    session.run({"x": x})
    x[0] = 100.0  # written between two runs of the same array
    expected_after = run_onnxruntime(mlp_model, {"x": x})["y"]
    np.testing.assert_allclose(session.run({"x": x})["y"], expected_after, rtol=1e-5, atol=1e-4)
    assert not np.allclose(expected, expected_after)


@pytest.mark.parametrize("viewable", [True, False])
def test_the_array_of_the_last_run_is_checked_again_once_it_changes(mlp_package, viewable):
    session = mlp_package.session()
    x = _array((3, 8), viewable)
    x[:] = 1.0
    session.run({"x": x})
    with pytest.raises(InputError, match=r"unknown \['extra'\]"):
        session.run({"x": x, "extra": x})
    x.shape = (3, 2, 4)  # the same array, reshaped in place
    with pytest.raises(InputError, match="must have rank 2"):
        session.run({"x": x})


def test_a_shape_returned_as_an_output_comes_back_as_int64_values():
    """ONNX's Shape of an input is a shape value in the VM, not a tensor; Session.run read its
    result as a tuple of tensors and raised a TypeError (11 onnx `test_shape*` cases)."""
    from onnx import TensorProto, helper

    import tightfit

    graph = helper.make_graph(
        [helper.make_node("Shape", ["x"], ["shape"]), helper.make_node("Relu", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, "w"])],
        [helper.make_tensor_value_info("shape", TensorProto.INT64, [3]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3, "w"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = tightfit.compile(model).session()
    for shape in [(2, 3, 5), (1, 3, 1)]:
        x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        result, expected = session.run({"x": x}), run_onnxruntime(model, {"x": x})
        assert result["shape"].dtype == np.int64
        np.testing.assert_array_equal(result["shape"], expected["shape"])
        np.testing.assert_array_equal(result["y"], expected["y"])


def test_inputs_that_fit_their_declarations_but_not_the_model_raise_an_input_error():
    """Each input fits its declared dims, but a dim the model computes from them disagrees with
    one it needs; TVM's own message named a Relax type and a heap register."""
    import tightfit
    from tightfit.testing import zoo

    model = zoo.get("reshape_to_computed_shape").build()
    session = tightfit.compile(model).session()
    x = np.ones((3, 3, 16), np.float32)  # onnxruntime: cannot reshape {3,3,16} to {4,32}
    with pytest.raises(InputError, match=r"cannot run on these inputs \(x 3x3x16\): inside it, "
                                         r"axis 0 of a tensor is \d+ where the graph needs \d+"):
        session.run({"x": x})
    fits = np.random.default_rng(0).standard_normal((4, 10, 16)).astype(np.float32)
    np.testing.assert_allclose(session.run({"x": fits})["y"], run_onnxruntime(model, {"x": fits})["y"],
                               rtol=1e-5, atol=1e-5)


def test_values_that_change_a_dim_the_model_needs_raise_an_input_error():
    """nonzero_rows_tied multiplies the rows whose sum is not NaN by v, whose rows must match."""
    import tightfit
    from tightfit.testing import zoo

    session = tightfit.compile(zoo.get("nonzero_rows_tied").build()).session()
    x = np.ones((3, 4), np.float32)
    x[1, 0] = np.nan
    with pytest.raises(InputError, match=r"\(x 3x4, v 3x8\): inside it, axis 1 of a tensor is 2 "
                                         r"where the graph needs 3.*the values do not"):
        session.run({"x": x, "v": np.ones((3, 8), np.float32)})
