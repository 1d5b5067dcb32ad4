"""tightfit's ONNX op converters: where TVM 0.27's importer fails on real models, and new ops.

Each class follows TVM's `OnnxOpConverter` protocol (`_impl_vN(cls, bb, inputs, attr, params)`,
the highest N not above the model's opset is used) and is listed in CONVERTERS, which the importer
consults before TVM's own table. Say in each docstring what TVM does wrong and for which models.
"""

from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter

CONVERTERS: dict[str, type[OnnxOpConverter]] = {}
