"""Indices checked when the model runs: Gather, GatherElements, GatherND, ScatterElements and
ScatterND give onnxruntime's outputs for indices in range (negative ones included) and raise
InputError, naming the node, for one out of range, where TVM's kernels read or write past the
data (frontend/ops_gather.py)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from onnx import TensorProto, helper, numpy_helper

import tightfit
from tightfit.errors import ConversionError, InputError
from tightfit.feeds import run_onnxruntime

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def model(node, inputs, outputs, initializers=()):
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(*spec) for spec in inputs],
                              [helper.make_tensor_value_info(*spec) for spec in outputs], list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def gather_model(axis: int):
    return model(helper.make_node("Gather", ["data", "indices"], ["y"], axis=axis, name="lookup"),
                 [("data", F, ["rows", "columns"]), ("indices", I64, ["count"])],
                 [("y", F, ["count", "columns"] if axis == 0 else ["rows", "count"])])


_GATHER_SESSIONS = {}


def gather_session(axis: int):
    if axis not in _GATHER_SESSIONS:
        _GATHER_SESSIONS[axis] = (gather_model(axis), tightfit.compile(gather_model(axis)).session())
    return _GATHER_SESSIONS[axis]


@settings(max_examples=40, deadline=None)
@given(axis=st.sampled_from([0, 1]), rows=st.integers(1, 6), columns=st.integers(1, 6),
       data=st.data())
def test_gather_matches_onnxruntime_and_raises_where_it_does(axis, rows, columns, data):
    onnx_model, session = gather_session(axis)
    extent = (rows, columns)[axis]
    indices = np.array(data.draw(st.lists(st.integers(-2 * extent, 2 * extent), min_size=1, max_size=5)),
                       np.int64)
    feeds = {"data": np.arange(rows * columns, dtype=np.float32).reshape(rows, columns), "indices": indices}
    in_range = bool(((indices >= -extent) & (indices < extent)).all())
    if in_range:
        np.testing.assert_array_equal(session.run(feeds)["y"], run_onnxruntime(onnx_model, feeds)["y"])
    else:
        with pytest.raises(Exception):  # onnxruntime's own error
            run_onnxruntime(onnx_model, feeds)
        bad = int(indices[(indices < -extent) | (indices >= extent)][0])
        with pytest.raises(InputError, match=f"Gather node lookup: index {bad} is out of range "
                                             f"for a dim of {extent}"):
            session.run(feeds)


def test_an_out_of_range_token_id_raises_and_the_session_runs_on():
    table = numpy_helper.from_array(np.arange(40, dtype=np.float32).reshape(10, 4), "table")
    onnx_model = model(helper.make_node("Gather", ["table", "tokens"], ["y"], name="embed"),
                       [("tokens", I64, ["batch", "sequence"])], [("y", F, ["batch", "sequence", 4])],
                       [table])
    session = tightfit.compile(onnx_model).session()
    with pytest.raises(InputError, match="Gather node embed: index 10 .*valid: -10 to 9"):
        session.run({"tokens": np.array([[1, 10]], np.int64)})
    feeds = {"tokens": np.array([[9, -1, 0]], np.int64)}
    np.testing.assert_array_equal(session.run(feeds)["y"], run_onnxruntime(onnx_model, feeds)["y"])


def test_a_large_index_tensor_is_checked_on_the_calling_thread():
    """Past the parallel threshold, the check still raises: TVM's pool would drop the error."""
    onnx_model, session = gather_session(0)
    indices = np.zeros(300_000, np.int64)
    indices[-1] = 3
    with pytest.raises(InputError, match="index 3 is out of range for a dim of 3"):
        session.run({"data": np.ones((3, 2), np.float32), "indices": indices})


DATA = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
INDEXING_CASES = {
    "GatherElements": (
        helper.make_node("GatherElements", ["data", "indices"], ["y"], axis=2, name="pick"),
        [("data", F, [2, 3, 4]), ("indices", I64, [2, 3, 2])],
        {"data": DATA, "indices": np.tile(np.array([3, -4], np.int64), (2, 3, 1))}, 4, [2, 3, 2]),
    "GatherND": (
        helper.make_node("GatherND", ["data", "indices"], ["y"], batch_dims=1, name="pick"),
        [("data", F, [2, 3, 4]), ("indices", I64, [2, 1, 2])],
        {"data": DATA, "indices": np.array([[[2, -1]], [[-3, 3]]], np.int64)}, 4, [2, 1]),
    "ScatterElements": (
        helper.make_node("ScatterElements", ["data", "indices", "updates"], ["y"], axis=1, name="put"),
        [("data", F, [2, 3, 4]), ("indices", I64, [2, 1, 4]), ("updates", F, [2, 1, 4])],
        {"data": DATA, "indices": np.array([[[0, -1, 2, -3]], [[1, 1, -2, 0]]], np.int64),
         "updates": -np.ones((2, 1, 4), np.float32)}, 3, [2, 3, 4]),
    "ScatterND": (
        helper.make_node("ScatterND", ["data", "indices", "updates"], ["y"], name="put"),
        [("data", F, [2, 3, 4]), ("indices", I64, [2, 2]), ("updates", F, [2, 4])],
        {"data": DATA, "indices": np.array([[1, -1], [0, 2]], np.int64),
         "updates": -np.ones((2, 4), np.float32)}, 3, [2, 3, 4]),
}


@pytest.mark.parametrize("op", sorted(INDEXING_CASES))
def test_every_indexing_op_checks_its_indices(op):
    node, inputs, feeds, last_extent, out_shape = INDEXING_CASES[op]
    onnx_model = model(node, inputs, [("y", F, out_shape)])
    session = tightfit.compile(onnx_model).session()
    np.testing.assert_array_equal(session.run(feeds)["y"], run_onnxruntime(onnx_model, feeds)["y"])
    bad = dict(feeds, indices=feeds["indices"].copy())
    bad["indices"].reshape(-1)[-1] = last_extent  # the last slot of the last index
    with pytest.raises(Exception):  # onnxruntime's own error
        run_onnxruntime(onnx_model, bad)
    with pytest.raises(InputError, match=f"{op} node {node.name}: index {last_extent} is out of range"):
        session.run(bad)


def test_a_constant_index_out_of_range_is_refused_when_compiling():
    indices = numpy_helper.from_array(np.array([0, 5], np.int64), "indices")
    onnx_model = model(helper.make_node("Gather", ["data", "indices"], ["y"], axis=1, name="cols"),
                       [("data", F, ["rows", 5])], [("y", F, ["rows", 2])], [indices])
    with pytest.raises(ConversionError, match="cols .*index 5 is out of range for a dim of 5"):
        tightfit.compile(onnx_model)


@pytest.mark.parametrize("name", ["nonzero_gather", "reshape_to_computed_shape", "transformer_encoder_dynamo"])
def test_compiling_gathers_logs_no_warning_about_fast_mode_segfaults(capfd, name):
    """TVM logs "Fast mode segfaults when there are out-of-bounds indices" for every take in
    its default mode that it lowers; tightfit's takes are of indices in range (take_in_range)."""
    from tightfit.testing import zoo

    capfd.readouterr()
    tightfit.compile(zoo.get(name).build())
    assert "Fast mode" not in capfd.readouterr().err


_SCATTER_SESSIONS = {}


def scatter_session(axis: int, reduction: str):
    """ScatterElements over dynamic dims, its indices of their own dims."""
    key = (axis, reduction)
    if key not in _SCATTER_SESSIONS:
        onnx_model = model(helper.make_node("ScatterElements", ["data", "indices", "updates"], ["y"], axis=axis,
                                            reduction=reduction, name="put"),
                           [("data", F, ["a", "b", "c"]), ("indices", I64, ["p", "q", "r"]),
                            ("updates", F, ["p", "q", "r"])], [("y", F, ["a", "b", "c"])])
        _SCATTER_SESSIONS[key] = (onnx_model, tightfit.compile(onnx_model).session())
    return _SCATTER_SESSIONS[key]


@settings(max_examples=30, deadline=None)
@given(axis=st.sampled_from([0, 1, 2]), reduction=st.sampled_from(["none", "add", "max"]), data=st.data())
def test_scatter_elements_with_indices_shorter_than_the_data_matches_onnxruntime(axis, reduction, data):
    """ONNX lets the indices be shorter than the data in every dim; TVM's kernel assumed the
    data's shape beside the axis and wrote such updates to the wrong elements."""
    onnx_model, session = scatter_session(axis, reduction)
    shape = [data.draw(st.integers(1, 4)) for _ in range(3)]
    index_shape = [data.draw(st.integers(1, length)) for length in shape]
    extent = shape[axis]
    other_dims = [length for dim, length in enumerate(index_shape) if dim != axis]
    if reduction == "none":  # onnxruntime keeps any one of repeated indices' updates
        along_axis = [data.draw(st.permutations(range(extent)))[:index_shape[axis]]
                      for _ in range(np.prod(other_dims))]
    else:  # repeated indices combine their updates
        index_shape[axis] = data.draw(st.integers(1, 5))
        along_axis = [data.draw(st.lists(st.integers(0, extent - 1), min_size=index_shape[axis],
                                         max_size=index_shape[axis])) for _ in range(np.prod(other_dims))]
    indices = np.moveaxis(np.array(along_axis, np.int64).reshape(*other_dims, index_shape[axis]), -1, axis)
    indices = np.where(data.draw(hnp.arrays(bool, index_shape)), indices - extent, indices).astype(np.int64)
    feeds = {"data": np.arange(np.prod(shape), dtype=np.float32).reshape(shape), "indices": indices,
             "updates": data.draw(hnp.arrays(np.float32, index_shape, elements=st.integers(-9, 9).map(float)))}
    np.testing.assert_array_equal(session.run(feeds)["y"], run_onnxruntime(onnx_model, feeds)["y"])
