"""Small models shared by the API, CLI and benchmark tests (the zoo lives in tightfit.testing)."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tightfit.examples.make_examples import convnet_dynamic


def tiny_mlp(seed: int = 0) -> onnx.ModelProto:
    """x[batch, 8] → MatMul → Add → Relu → MatMul: y[batch, 4]; batch is dynamic."""
    rng = np.random.default_rng(seed)
    initializers = [
        numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.standard_normal((16,)).astype(np.float32), "b1"),
        numpy_helper.from_array(rng.standard_normal((16, 4)).astype(np.float32), "w2"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
        helper.make_node("Add", ["h", "b1"], ["hb"], name="bias1"),
        helper.make_node("Relu", ["hb"], ["a"], name="relu1"),
        helper.make_node("MatMul", ["a", "w2"], ["y"], name="fc2"),
    ]
    graph = helper.make_graph(
        nodes, "tiny_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="session")
def mlp_model() -> onnx.ModelProto:
    return tiny_mlp()


@pytest.fixture(scope="session")
def mlp_path(tmp_path_factory, mlp_model) -> str:
    path = tmp_path_factory.mktemp("models") / "tiny_mlp.onnx"
    onnx.save(mlp_model, str(path))
    return str(path)


@pytest.fixture(scope="session")
def convnet_model() -> onnx.ModelProto:
    return convnet_dynamic()


@pytest.fixture(scope="session")
def mlp_package(mlp_model):
    import tightfit

    return tightfit.compile(mlp_model)
