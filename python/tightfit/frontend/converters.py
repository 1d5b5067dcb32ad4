"""tightfit's ONNX op converters, gathered from the `ops_*.py` modules beside this file.

Each module holds converters for one family of ops and exposes its own `CONVERTERS` dict (ONNX op
type → class). A class follows TVM's `OnnxOpConverter` protocol (`_impl_vN(cls, bb, inputs, attr,
params)`; the highest N not above the model's opset is used). The importer consults this table
before TVM's own, so a class here replaces TVM's converter for that op. Each docstring says what
TVM 0.27 does wrong and which models need the fix.
"""

from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter

from . import ops_attention, ops_constant, ops_loss, ops_normalization, ops_reduce, ops_shape, ops_tensor
from . import ops_conv, ops_detection, ops_gather, ops_math, ops_pad

CONVERTER_MODULES = [ops_shape, ops_reduce, ops_attention, ops_loss, ops_constant, ops_normalization,
                     ops_tensor]
CONVERTER_MODULES += [ops_pad, ops_math, ops_gather, ops_conv, ops_detection]

CONVERTERS: dict[str, type[OnnxOpConverter]] = {}
for _module in CONVERTER_MODULES:
    _clash = set(CONVERTERS) & set(_module.CONVERTERS)
    assert not _clash, f"{_module.__name__} converts {_clash} again"
    CONVERTERS.update(_module.CONVERTERS)
