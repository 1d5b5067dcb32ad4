"""Example models built from code; `python -m tightfit.examples.make_examples` rewrites the
bundled `convnet_dynamic.onnx`.

- `convnet_dynamic`: a small MobileNetV2-style network (a stem conv, two inverted-residual blocks
  with depthwise convolutions and ReLU6, global pooling and a classifier) whose batch, height and
  width are dynamic. Bundled, 27 kB.
- `vgg_style`: VGG's shape in small — a few 3x3 conv/ReLU/max-pool stages on a 32x32 image, then
  the large fully connected layers that hold most of VGG's weights (about 113 MB at the default
  width, 4096). Not bundled; built on demand for weight-loading benchmarks.
Weights are random with a fixed seed, so the models are reproducible.
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


def vgg_style(fc_width: int = 4096, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    initializers, nodes = [], []
    source, channels, size = "image", 3, 32
    for stage, width in enumerate([32, 64, 128]):
        weight = (rng.standard_normal((width, channels, 3, 3)) * np.sqrt(2 / (9 * channels))).astype(np.float32)
        initializers += [numpy_helper.from_array(weight, f"conv{stage}.weight"),
                         numpy_helper.from_array(np.zeros(width, np.float32), f"conv{stage}.bias")]
        nodes += [
            helper.make_node("Conv", [source, f"conv{stage}.weight", f"conv{stage}.bias"], [f"c{stage}"],
                             kernel_shape=[3, 3], pads=[1, 1, 1, 1], name=f"conv{stage}"),
            helper.make_node("Relu", [f"c{stage}"], [f"r{stage}"], name=f"relu{stage}"),
            helper.make_node("MaxPool", [f"r{stage}"], [f"p{stage}"], kernel_shape=[2, 2],
                             strides=[2, 2], name=f"pool{stage}"),
        ]
        source, channels, size = f"p{stage}", width, size // 2
    nodes.append(helper.make_node("Flatten", [source], ["flat"], axis=1, name="flatten"))
    features = channels * size * size
    for index, (fan_in, fan_out) in enumerate([(features, fc_width), (fc_width, fc_width), (fc_width, 1000)]):
        weight = (rng.standard_normal((fan_out, fan_in)) * np.sqrt(2 / fan_in)).astype(np.float32)
        initializers += [numpy_helper.from_array(weight, f"fc{index}.weight"),
                         numpy_helper.from_array(np.zeros(fan_out, np.float32), f"fc{index}.bias")]
        source_name = "flat" if index == 0 else f"a{index - 1}"
        nodes.append(helper.make_node("Gemm", [source_name, f"fc{index}.weight", f"fc{index}.bias"],
                                      [f"f{index}"], transB=1, name=f"fc{index}"))
        if index < 2:
            nodes.append(helper.make_node("Relu", [f"f{index}"], [f"a{index}"], name=f"fc{index}.relu"))
    graph = helper.make_graph(
        nodes, "vgg_style",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, 32, 32])],
        [helper.make_tensor_value_info("f2", TensorProto.FLOAT, ["batch", 1000])],
        initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                             producer_name="tightfit.examples")


BUILTIN = {"convnet_dynamic": convnet_dynamic, "vgg_style": vgg_style}


if __name__ == "__main__":
    onnx.save(convnet_dynamic(), str(EXAMPLES / "convnet_dynamic.onnx"))
    print(f"wrote {EXAMPLES / 'convnet_dynamic.onnx'}")
