"""`ConvTranspose` with an `output_shape`.

TVM 0.27's converter ignores the attribute: ONNX's test_convtranspose_output_shape (input 3 x 3,
strides 3 x 2, output_shape 10 x 8) came out 9 x 7. ONNX derives the pads from it: the total
padding of a spatial dim is its natural size, stride x (in - 1) + output_padding + (kernel - 1)
x dilation + 1, less the wanted size; with auto_pad SAME_UPPER the start gets total // 2 and
the end the rest, otherwise the other way round. A wanted size above the natural one gets no
padding (onnxruntime clamps the total at 0), and its extra rows and columns, at the end, hold
only the bias. The input's spatial dims must be static here, as the pads depend on them.
"""

from __future__ import annotations

from tvm import relax, tirx
from tvm.relax.frontend.onnx import onnx_frontend

from ..errors import ConversionError


class ConvTranspose(onnx_frontend.ConvTranspose):
    """ConvTranspose whose `output_shape` sets its pads (and zero rows and columns past the
    natural size)."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        if "output_shape" not in attr:
            return super()._impl_v1(bb, inputs, attr, params)
        data, weight, bias = inputs[0], inputs[1], inputs[2]  # the importer pads with None
        spatial = data.ty.ndim - 2
        wanted = [int(size) for size in attr.pop("output_shape")][-spatial:]
        sizes = data.ty.shape.values[2:] if data.ty.shape is not None else None
        if sizes is None or not all(isinstance(size, tirx.IntImm) for size in sizes):
            raise ConversionError(attr["tvm_custom"]["name"], "ConvTranspose",
                                  "output_shape needs the input's spatial dims static (the pads "
                                  "depend on them)")
        strides = attr.get("strides", [1] * spatial)
        dilations = attr.get("dilations", [1] * spatial)
        output_padding = attr.get("output_padding", [0] * spatial)
        kernel = attr.get("kernel_shape") or [int(size) for size in weight.ty.shape.values[2:]]
        auto_pad = attr.pop("auto_pad", b"NOTSET")
        same_upper = (auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad) == "SAME_UPPER"
        starts, ends, extra = [], [], []
        for i in range(spatial):
            natural = (strides[i] * (int(sizes[i]) - 1) + output_padding[i]
                       + (kernel[i] - 1) * dilations[i] + 1)
            total = max(0, natural - wanted[i])
            start = total // 2 if same_upper else total - total // 2
            starts.append(start)
            ends.append(total - start)
            extra.append(max(0, wanted[i] - natural))
        attr["pads"] = starts + ends
        out = super()._impl_v1(bb, [data, weight, None], attr, params)
        if any(extra):
            out = relax.op.nn.pad(out, [0, 0, 0, 0] + [width for size in extra for width in (0, size)])
        if bias is not None:
            out = relax.op.add(out, relax.op.reshape(bias, [1, -1] + [1] * spatial))
        return out


CONVERTERS = {"ConvTranspose": ConvTranspose}
