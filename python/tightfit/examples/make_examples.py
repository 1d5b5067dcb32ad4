"""Rebuild the bundled example models: `python -m tightfit.examples.make_examples`.

`convnet_dynamic.onnx` is a small MobileNetV2-style network (a stem conv, two inverted-residual
blocks with depthwise convolutions and ReLU6, global pooling and a classifier) whose batch, height
and width are dynamic. Weights are random with a fixed seed, so the file is reproducible.
"""

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

EXAMPLES = Path(__file__).parent


def convnet_dynamic(seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    initializers = []
    nodes = []

    def weight(name: str, shape: tuple[int, ...]) -> str:
        fan_in = int(np.prod(shape[1:])) or 1
        data = (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)
        initializers.append(numpy_helper.from_array(data, name))
        return name

    def conv(name: str, source: str, out_channels: int, in_channels: int, kernel: int,
             stride: int = 1, groups: int = 1, relu6: bool = True) -> str:
        w = weight(f"{name}.weight", (out_channels, in_channels // groups, kernel, kernel))
        b = weight(f"{name}.bias", (out_channels,))
        pad = kernel // 2
        nodes.append(helper.make_node("Conv", [source, w, b], [f"{name}.out"], name=name,
                                      kernel_shape=[kernel, kernel], strides=[stride, stride],
                                      pads=[pad] * 4, group=groups))
        if not relu6:
            return f"{name}.out"
        nodes.append(helper.make_node("Clip", [f"{name}.out", "relu6.min", "relu6.max"],
                                      [f"{name}.act"], name=f"{name}.relu6"))
        return f"{name}.act"

    initializers += [numpy_helper.from_array(np.array(0.0, np.float32), "relu6.min"),
                     numpy_helper.from_array(np.array(6.0, np.float32), "relu6.max")]
    x = conv("stem", "image", 16, 3, 3, stride=2)
    for index, (channels, expand) in enumerate([(16, 4), (16, 4)]):
        hidden = channels * expand
        y = conv(f"block{index}.expand", x, hidden, channels, 1)
        y = conv(f"block{index}.depthwise", y, hidden, hidden, 3, groups=hidden)
        y = conv(f"block{index}.project", y, channels, hidden, 1, relu6=False)
        nodes.append(helper.make_node("Add", [x, y], [f"block{index}.sum"], name=f"block{index}.residual"))
        x = f"block{index}.sum"
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["pooled"], name="pool"))
    nodes.append(helper.make_node("Flatten", ["pooled"], ["features"], name="flatten", axis=1))
    classifier = weight("classifier.weight", (10, 16))
    classifier_bias = weight("classifier.bias", (10,))
    nodes.append(helper.make_node("Gemm", ["features", classifier, classifier_bias], ["logits"],
                                  name="classifier", transB=1))
    graph = helper.make_graph(
        nodes, "convnet_dynamic",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, "height", "width"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="tightfit.examples")
    onnx.checker.check_model(model)
    return model


if __name__ == "__main__":
    onnx.save(convnet_dynamic(), str(EXAMPLES / "convnet_dynamic.onnx"))
    print(f"wrote {EXAMPLES / 'convnet_dynamic.onnx'}")
