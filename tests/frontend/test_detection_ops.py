"""NonMaxSuppression with its limits as initializers matches onnxruntime (boxes given by corners
and by centres, several classes and images, the thresholds absent or set); limits fed as graph
inputs are refused with an error that names them, where TVM's converter used defaults."""

import numpy as np
import pytest
from onnx import TensorProto, helper

import tightfit
from tightfit.errors import ConversionError
from tightfit.feeds import run_onnxruntime


def nms_model(limits: dict, center_point_box: int = 0, as_inputs: tuple = ()):
    """NMS over boxes [2, 6, 4] and scores [2, 3, 6]; `limits` maps each limit given to its value,
    an initializer unless named in `as_inputs`."""
    names = ["max_output_boxes_per_class", "iou_threshold", "score_threshold"]
    given = [name for name in names if name in limits]
    node_inputs = ["boxes", "scores"] + [name if name in limits else "" for name in names]
    while node_inputs[-1] == "":
        node_inputs.pop()
    kinds = {"max_output_boxes_per_class": TensorProto.INT64}
    graph = helper.make_graph(
        [helper.make_node("NonMaxSuppression", node_inputs, ["selected"], center_point_box=center_point_box)],
        "nms",
        [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [2, 6, 4]),
         helper.make_tensor_value_info("scores", TensorProto.FLOAT, [2, 3, 6])]
        + [helper.make_tensor_value_info(name, kinds.get(name, TensorProto.FLOAT), [1]) for name in as_inputs],
        [helper.make_tensor_value_info("selected", TensorProto.INT64, [None, 3])],
        [helper.make_tensor(name, kinds.get(name, TensorProto.FLOAT), [1], [limits[name]])
         for name in given if name not in as_inputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def feeds(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    corners = rng.uniform(0, 10, (2, 6, 2)).astype(np.float32)
    sizes = rng.uniform(1, 4, (2, 6, 2)).astype(np.float32)
    boxes = np.concatenate([corners, corners + sizes], axis=2)
    return {"boxes": boxes, "scores": rng.uniform(0, 1, (2, 3, 6)).astype(np.float32)}


@pytest.mark.parametrize("limits", [
    {"max_output_boxes_per_class": 3},
    {"max_output_boxes_per_class": 6, "iou_threshold": 0.3},
    {"max_output_boxes_per_class": 2, "iou_threshold": 0.5, "score_threshold": 0.4},
], ids=["max only", "max and iou", "all three"])
@pytest.mark.parametrize("center_point_box", [0, 1])
def test_nms_with_initializer_limits_matches_onnxruntime(limits, center_point_box):
    model = nms_model(limits, center_point_box)
    session = tightfit.compile(model).session()
    for seed in range(3):
        inputs = feeds(seed)
        np.testing.assert_array_equal(session.run(inputs)["selected"], run_onnxruntime(model, inputs)["selected"],
                                      err_msg=f"seed {seed}")


@pytest.mark.parametrize("name", ["max_output_boxes_per_class", "iou_threshold", "score_threshold"])
def test_a_limit_fed_as_a_graph_input_is_refused_by_name(name):
    limits = {"max_output_boxes_per_class": 3, "iou_threshold": 0.5, "score_threshold": 0.1}
    with pytest.raises(ConversionError, match=f"{name} is a graph input"):
        tightfit.compile(nms_model(limits, as_inputs=(name,)))


def test_a_box_whose_iou_equals_the_threshold_is_kept_as_onnxruntime_keeps_it():
    model = nms_model({"max_output_boxes_per_class": 6, "iou_threshold": 0.5})
    inputs = feeds(0)
    inputs["boxes"][:, 0] = [0.0, 0.0, 1.0, 1.0]
    inputs["boxes"][:, 1] = [0.0, 0.0, 1.0, 0.5]  # IoU with box 0: 0.5 / 1.0
    expected = run_onnxruntime(model, inputs)["selected"]
    np.testing.assert_array_equal(tightfit.compile(model).session().run(inputs)["selected"], expected)
