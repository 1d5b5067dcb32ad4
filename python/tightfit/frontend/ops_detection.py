"""Detection post-processing ops whose TVM 0.27 converters stop short of the ONNX specification.

- `NonMaxSuppression`: TVM's kernel takes max_output_boxes_per_class, iou_threshold and
  score_threshold when it is compiled. Its converter reads them from constants and initializers
  and silently uses 0 boxes, an IoU of 0.5 and a score of 0 for anything else: with the limits
  fed as graph inputs, a model compiled, ran, and returned no boxes, or the wrong ones. A limit
  given as a graph input is refused here with an error that says so; an absent iou_threshold is
  0 and an absent score_threshold filters nothing, as ONNX specifies (TVM: 0.5 and 0).
  TVM's kernel suppresses a box whose IoU with a kept one is >= the threshold, and selects
  nothing at a threshold of 0; onnxruntime suppresses at > the threshold. The kernel gets the
  next float32 above the threshold, so that >= it is > the threshold for every float32 IoU.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend

LIMITS = ("max_output_boxes_per_class", "iou_threshold", "score_threshold")


class NonMaxSuppression(onnx_frontend.NonMaxSuppression):
    """Limits known when compiling, or a clear refusal."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        inputs = list(inputs) + [None] * (2 + len(LIMITS) - len(inputs))
        for name, value in zip(LIMITS, inputs[2:]):
            if value is not None and not _known_when_compiling(value, params):
                raise ValueError(f"NonMaxSuppression's {name} is a graph input: tightfit's kernel sizes its "
                                 f"output and sets its thresholds when compiled, so make {name} a constant or "
                                 "an initializer of the model")
        iou_threshold = 0.0 if inputs[3] is None else _value(inputs[3], params)
        inputs[3] = relax.const(np.nextafter(np.float32(iou_threshold), np.float32(np.inf)), "float32")
        if inputs[4] is None:
            inputs[4] = relax.const(-np.inf, "float32")
        return super()._impl_v10(bb, inputs, attr, params)


def _value(value, params) -> float:
    if isinstance(value, tvm.ir.GenericConst):
        return float(value.value.numpy().item())
    return float(params[1][value.name][1].numpy().item())


def _known_when_compiling(value, params) -> bool:
    return isinstance(value, tvm.ir.GenericConst) or (
        isinstance(value, relax.Var) and value.name in params[1])


CONVERTERS = {"NonMaxSuppression": NonMaxSuppression}
