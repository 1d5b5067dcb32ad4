"""Arrays cross into and out of a host session without copies, and never alias what they must not."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import tightfit
from tightfit.feeds import run_onnxruntime


def test_outputs_of_earlier_runs_keep_their_values(mlp_package):
    session = mlp_package.session()
    rng = np.random.default_rng(0)
    first = session.run({"x": rng.standard_normal((3, 8)).astype(np.float32)})["y"]
    kept = first.copy()
    for batch in (3, 3, 5):
        session.run({"x": rng.standard_normal((batch, 8)).astype(np.float32)})
    np.testing.assert_array_equal(first, kept)


@pytest.mark.parametrize("layout", ["aligned", "unaligned", "read-only", "strided"])
def test_any_input_array_gives_the_same_outputs(mlp_package, layout):
    session = mlp_package.session()
    x = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    expected = session.run({"x": x.copy()})["y"]
    if layout == "aligned":
        buffer = np.empty(x.nbytes + 64, np.uint8)
        start = -buffer.ctypes.data % 64
        fed = buffer[start:start + x.nbytes].view(np.float32).reshape(x.shape)
        fed[...] = x
    elif layout == "unaligned":
        fed = np.frombuffer(bytearray(b"\0" * 4) + bytearray(x.tobytes()), np.float32, offset=4).reshape(x.shape)
    elif layout == "read-only":
        fed = x.copy()
        fed.flags.writeable = False
    else:
        fed = np.repeat(x, 2, axis=1)[:, ::2]
    np.testing.assert_array_equal(session.run({"x": fed})["y"], expected)
    np.testing.assert_array_equal(fed, x)  # the model never writes into its input


def passthrough_model():
    """y = x (an output that is the input itself) and c = reshape(weight) (one that is a weight)."""
    weight = np.arange(6, dtype=np.float32)
    nodes = [helper.make_node("Identity", ["x"], ["y"]),
             helper.make_node("Reshape", ["weight", "shape"], ["c"])]
    graph = helper.make_graph(
        nodes, "passthrough",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4]),
         helper.make_tensor_value_info("c", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(weight, "weight"), numpy_helper.from_array(np.array([2, 3]), "shape")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_outputs_that_are_inputs_or_weights_are_copies(tmp_path):
    tightfit.compile(passthrough_model()).save(tmp_path / "passthrough.tfpkg")
    session = tightfit.load(tmp_path / "passthrough.tfpkg").session()  # weights mapped read-only
    x = np.ones((2, 4), np.float32)
    outputs = session.run({"x": x})
    outputs["y"][...] = 7  # writing to an output changes neither the input nor the weights
    outputs["c"][...] = 7
    np.testing.assert_array_equal(x, np.ones((2, 4), np.float32))
    again = session.run({"x": x})
    np.testing.assert_array_equal(again["c"], np.arange(6, dtype=np.float32).reshape(2, 3))


@pytest.mark.parametrize("layout", ["unaligned", "strided"])
def test_inputs_viewed_or_staged_leave_earlier_outputs_alone(layout):
    """An unaligned input is viewed where it lies; one TVM cannot view (strided) is copied into
    a buffer the session keeps for that input. Either way an output that is that input
    (Identity) must still be the earlier run's values afterwards."""
    session = tightfit.compile(passthrough_model()).session()

    def fed(value: float, rows: int) -> np.ndarray:
        if layout == "strided":
            return np.full((rows, 8), value, np.float32)[:, ::2]
        raw = bytearray(b"\0" * 4) + bytearray(np.full((rows, 4), value, np.float32).tobytes())
        return np.frombuffer(raw, np.float32, offset=4).reshape(rows, 4)

    first = session.run({"x": fed(1.0, 2)})["y"]
    second = session.run({"x": fed(-2.0, 2)})["y"]
    third = session.run({"x": fed(3.0, 5)})["y"]  # a new shape gets a new buffer
    np.testing.assert_array_equal(first, np.full((2, 4), 1.0, np.float32))
    np.testing.assert_array_equal(second, np.full((2, 4), -2.0, np.float32))
    np.testing.assert_array_equal(third, np.full((5, 4), 3.0, np.float32))


def reshaped_outputs_model():
    """z = reshape(relu(x)) alone, and y = relu(x) beside r = reshape(y): views of one result."""
    nodes = [helper.make_node("Relu", ["x"], ["y"]),
             helper.make_node("Reshape", ["y", "shape"], ["r"]),
             helper.make_node("Relu", ["x"], ["y2"]),
             helper.make_node("Reshape", ["y2", "shape"], ["z"])]
    graph = helper.make_graph(
        nodes, "reshaped_outputs",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4]),
         helper.make_tensor_value_info("r", TensorProto.FLOAT, ["m", 2]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, ["m", 2])],
        [numpy_helper.from_array(np.array([-1, 2]), "shape")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_reshaped_result_is_handed_out_without_a_copy_unless_another_output_shares_it():
    """The VM's reshape is a view: an output that is a view of a fresh result is fresh (no
    ~5 us copy), but two outputs viewing one result are both copied, so that writing one leaves
    the other alone; either way an earlier run's outputs keep their values."""
    package = tightfit.compile(reshaped_outputs_model())
    session = package.session()
    x = np.arange(-4, 4, dtype=np.float32).reshape(2, 4)
    outputs = session.run({"x": x})
    fresh = dict(zip(session.output_names, package.fresh_outputs))
    assert fresh["z"] and not fresh["y"] and not fresh["r"]
    kept = {name: value.copy() for name, value in outputs.items()}
    outputs["y"][...] = 7
    np.testing.assert_array_equal(outputs["r"], kept["r"])
    session.run({"x": -x})
    np.testing.assert_array_equal(outputs["z"], kept["z"])
    np.testing.assert_array_equal(kept["z"], np.maximum(x, 0).reshape(-1, 2))


def test_a_tuple_of_outputs_is_read_the_same_way_in_every_run():
    """After the first run shows a tuple of tensors, later runs read it by index alone."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Sigmoid", ["x"], ["z"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = tightfit.compile(model).session()
    runs = []
    for rows in [2, 5, 1]:
        x = np.random.default_rng(rows).standard_normal((rows, 3)).astype(np.float32)
        runs.append((session.run({"x": x}), run_onnxruntime(model, {"x": x})))
        assert session._tuple_of_outputs
    for outputs, expected in runs:  # each run's outputs its own, left alone by the later runs
        assert list(outputs) == ["y", "z"]
        for name in outputs:
            np.testing.assert_allclose(outputs[name], expected[name], rtol=1e-5, atol=1e-6)
