"""The model zoo: small models built from code, covering what real ONNX files contain.

Each entry builds an `onnx.ModelProto` with random weights (fixed seed; nothing is downloaded) and
names the input shapes it is tested and benchmarked at. Models built with `onnx.helper` cover
static and dynamic CNNs, an `If` and data-dependent shapes; models built in PyTorch and exported
with `torch.onnx.export` with `dynamic_axes` carry the patterns most users' files have: attention
scaling constants, shape arithmetic feeding Reshape, Resize to a size taken from another tensor.
The PyTorch models are exported by both of torch's exporters, TorchScript (`dynamo=False`) and
dynamo, whose graphs differ (nn.TransformerEncoder by dynamo only: TorchScript cannot). Torch is
imported only to export a torch model; each export is made once and kept in the user cache
(`_exported_once`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import io
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto, helper, numpy_helper

from .. import user_cache
from ..examples.make_examples import convnet_dynamic
from . import rdp_cases

OPSET = 17
DYNAMO_OPSET = 18  # the dynamo exporter's own default


@dataclass(frozen=True)
class ZooModel:
    """A zoo entry: how to build the model and the input shapes it is checked and timed at.

    `feeds` makes inputs from a shape set where random normal floats would not exercise the model
    (integer token ids, both branches of an `If`); None means random normal floats suffice.
    A dynamic model has at least two shape sets, all served by one compiled package.
    """

    name: str
    build: Callable[[], onnx.ModelProto]
    shape_sets: list[dict[str, tuple[int, ...]]]
    feeds: Callable[[dict[str, tuple[int, ...]]], dict[str, np.ndarray]] | None
    dynamic: bool
    description: str

    def __post_init__(self):
        if self.dynamic and len(self.shape_sets) < 2:
            raise ValueError(f"zoo model {self.name} is dynamic but has fewer than two shape sets")
        if not self.shape_sets:
            raise ValueError(f"zoo model {self.name} has no shape set")


# --- models built with onnx.helper ---------------------------------------------------------------

class _GraphBuilder:
    """Appends nodes and random initializers; names are unique by construction."""

    def __init__(self, seed: int, prefix: str = ""):
        self.rng = np.random.default_rng(seed)
        self.prefix = prefix
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.count = 0

    def const(self, value: np.ndarray, name: str | None = None) -> str:
        name = name or self._fresh("c")
        self.initializers.append(numpy_helper.from_array(value, name))
        return name

    def weight(self, shape: tuple[int, ...], scale: float | None = None) -> str:
        fan_in = int(np.prod(shape[1:])) or 1
        scale = np.sqrt(2.0 / fan_in) if scale is None else scale
        return self.const((self.rng.standard_normal(shape) * scale).astype(np.float32))

    def op(self, op_type: str, inputs: list[str], outputs: int = 1, out: str | None = None,
           **attributes) -> str | list[str]:
        names = [out] if out else [self._fresh(op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, names, name=self._fresh(op_type), **attributes))
        return names[0] if outputs == 1 else names

    def conv(self, x: str, c_in: int, c_out: int, kernel: int, stride: int = 1, groups: int = 1,
             out: str | None = None) -> str:
        w = self.weight((c_out, c_in // groups, kernel, kernel))
        b = self.const(self.rng.standard_normal(c_out).astype(np.float32) * 0.1)
        return self.op("Conv", [x, w, b], out=out, kernel_shape=[kernel, kernel],
                       strides=[stride, stride], pads=[kernel // 2] * 4, group=groups)

    def batch_norm(self, x: str, channels: int, gain: float = 1.0) -> str:
        scale = self.const((gain * (1 + 0.1 * self.rng.standard_normal(channels))).astype(np.float32))
        bias = self.const((0.1 * self.rng.standard_normal(channels)).astype(np.float32))
        mean = self.const((0.1 * self.rng.standard_normal(channels)).astype(np.float32))
        var = self.const((1 + 0.1 * self.rng.random(channels)).astype(np.float32))
        return self.op("BatchNormalization", [x, scale, bias, mean, var])

    def model(self, name: str, inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto]):
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="tightfit.testing.zoo")
        onnx.checker.check_model(model)
        return model

    def _fresh(self, prefix: str) -> str:
        self.count += 1
        return f"{self.prefix}{prefix}_{self.count}"


def resnet_style() -> onnx.ModelProto:
    """Conv-BN-ReLU stem, two residual stages (the second downsamples with a 1x1 projection),
    global pooling and a fully connected classifier. Batch is dynamic, images 32x32."""
    g = _GraphBuilder(seed=1)
    x = g.op("Relu", [g.batch_norm(g.conv("image", 3, 16, 3), 16)])
    for stage, (c_in, c_out, stride) in enumerate([(16, 16, 1), (16, 32, 2)]):
        y = g.op("Relu", [g.batch_norm(g.conv(x, c_in, c_out, 3, stride), c_out)])
        y = g.batch_norm(g.conv(y, c_out, c_out, 3), c_out)
        shortcut = x if stride == 1 and c_in == c_out else g.batch_norm(g.conv(x, c_in, c_out, 1, stride), c_out)
        x = g.op("Relu", [g.op("Add", [y, shortcut])])
    pooled = g.op("Flatten", [g.op("GlobalAveragePool", [x])], axis=1)
    g.op("Gemm", [pooled, g.weight((10, 32)), g.const(np.zeros(10, np.float32))], out="logits", transB=1)
    return g.model("resnet_style",
                   [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, 32, 32])],
                   [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])])


def resnet18() -> onnx.ModelProto:
    """ResNet-18 at full size (He et al. 2016, table 1: a 7x7 stride-2 stem and max pool, four
    stages of two basic blocks at 64, 128, 256 and 512 channels, each later stage downsampling
    with a stride-2 3x3 conv and a 1x1 stride-2 projection; 11.7 M parameters, 1.8 GMAC at
    224 x 224) with random weights and batch-norm statistics: the layers of the ResNets the
    compilers are usually measured on. Each block's last batch norm scales by ~0.2 (as
    zero-init residual training leaves it small), so that the random net's activations stay in
    range through the eight residual additions. Batch, height and width are dynamic."""
    g = _GraphBuilder(seed=7)
    x = g.op("Relu", [g.batch_norm(g.conv("image", 3, 64, 7, stride=2), 64)])
    x = g.op("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    channels = 64
    for stage_channels in (64, 128, 256, 512):
        for block in range(2):
            stride = 2 if block == 0 and stage_channels != 64 else 1
            y = g.op("Relu", [g.batch_norm(g.conv(x, channels, stage_channels, 3, stride), stage_channels)])
            y = g.batch_norm(g.conv(y, stage_channels, stage_channels, 3), stage_channels, gain=0.2)
            shortcut = x if stride == 1 else g.batch_norm(g.conv(x, channels, stage_channels, 1, stride),
                                                          stage_channels)
            x = g.op("Relu", [g.op("Add", [y, shortcut])])
            channels = stage_channels
    pooled = g.op("Flatten", [g.op("GlobalAveragePool", [x])], axis=1)
    g.op("Gemm", [pooled, g.weight((1000, 512)), g.const(np.zeros(1000, np.float32))],
         out="logits", transB=1)
    return g.model("resnet18",
                   [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, "height", "width"])],
                   [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 1000])])


def conv_dynamic_hw() -> onnx.ModelProto:
    """A fully convolutional net (conv, max-pool, conv, per-pixel 1x1 head) whose height and width
    are dynamic, with an odd-size pooling edge (floor mode)."""
    g = _GraphBuilder(seed=2)
    x = g.op("Relu", [g.conv("image", 3, 12, 3)])
    x = g.op("MaxPool", [x], kernel_shape=[2, 2], strides=[2, 2])
    x = g.op("Relu", [g.conv(x, 12, 24, 3)])
    g.conv(x, 24, 5, 1, out="scores")
    return g.model("conv_dynamic_hw",
                   [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, "height", "width"])],
                   [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 5, "out_h", "out_w"])])


def grouped_convnet() -> onnx.ModelProto:
    """Grouped convolutions as ShuffleNet (v1) and ResNeXt use them: two ShuffleNet units (a
    1x1 conv in 3 groups, the channel shuffle as Reshape-Transpose-Reshape to the input's own
    shape, a depthwise 3x3, a 1x1 conv in 3 groups, the residual add), then a ResNeXt
    bottleneck whose 3x3 conv runs in 8 groups of 8 channels at stride 2, global pooling and a
    classifier. Batch, height and width are dynamic."""
    g = _GraphBuilder(seed=6)
    x = g.op("MaxPool", [g.op("Relu", [g.conv("image", 3, 24, 3, stride=2)])],
             kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    x = g.op("Relu", [g.conv(x, 24, 120, 1)])
    groups, bottleneck = 3, 30
    for _ in range(2):
        y = g.op("Relu", [g.batch_norm(g.conv(x, 120, bottleneck, 1, groups=groups), bottleneck)])
        grouped = g.op("Reshape", [y, g.const(np.array([0, groups, bottleneck // groups, -1], np.int64))])
        shuffled = g.op("Transpose", [grouped], perm=[0, 2, 1, 3])
        y = g.op("Reshape", [shuffled, g.op("Shape", [y])])
        y = g.batch_norm(g.conv(y, bottleneck, bottleneck, 3, groups=bottleneck), bottleneck)
        y = g.batch_norm(g.conv(y, bottleneck, 120, 1, groups=groups), 120)
        x = g.op("Relu", [g.op("Add", [x, y])])
    y = g.op("Relu", [g.conv(x, 120, 64, 1)])
    y = g.op("Relu", [g.conv(y, 64, 64, 3, stride=2, groups=8)])
    y = g.conv(y, 64, 128, 1)
    x = g.op("Relu", [g.op("Add", [y, g.conv(x, 120, 128, 1, stride=2)])])
    pooled = g.op("Flatten", [g.op("GlobalAveragePool", [x])], axis=1)
    g.op("Gemm", [pooled, g.weight((10, 128)), g.const(np.zeros(10, np.float32))], out="logits",
         transB=1)
    return g.model("grouped_convnet",
                   [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, "height", "width"])],
                   [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])])


def gated_skip_block() -> onnx.ModelProto:
    """SkipNet-style gating: an `If` on mean(x) > 0 runs a conv block (then) or only scales the
    input (else); both branches give the same shape."""
    g = _GraphBuilder(seed=3)
    gate = g.op("Greater", [g.op("ReduceMean", ["x"], keepdims=0), g.const(np.array(0.0, np.float32))])

    then_graph = _GraphBuilder(seed=4, prefix="then_")
    then_graph.op("Relu", [then_graph.conv("x", 8, 8, 3)], out="then_out")
    else_graph = _GraphBuilder(seed=5, prefix="else_")
    else_graph.op("Mul", ["x", else_graph.const(np.array(0.5, np.float32))], out="else_out")

    def branch(builder, name, output):
        return helper.make_graph(builder.nodes, name, [],
                                 [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["batch", 8, 16, 16])],
                                 builder.initializers)

    g.nodes.append(helper.make_node("If", [gate], ["gated"], name="gate",
                                    then_branch=branch(then_graph, "then", "then_out"),
                                    else_branch=branch(else_graph, "else", "else_out")))
    g.op("Add", ["gated", "x"], out="y")
    return g.model("gated_skip_block",
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8, 16, 16])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8, 16, 16])])


def _signed_feeds(shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Drive an If on mean(x) > 0 both ways: positive mean for an even batch size, negative for odd."""
    shape = shapes["x"]
    rng = np.random.default_rng(shape[0])
    sign = 1.0 if shape[0] % 2 == 0 else -1.0
    return {"x": (rng.standard_normal(shape) + 2 * sign).astype(np.float32)}


def nonzero_gather() -> onnx.ModelProto:
    """Data-dependent shapes: the positions where x > 0 (NonZero, count known only at run time)
    gather a feature row each, which a linear layer maps; the rows are then summed."""
    g = _GraphBuilder(seed=6)
    mask = g.op("Greater", ["x", g.const(np.array(0.0, np.float32))])
    positions = g.op("Transpose", [g.op("NonZero", [mask])], perm=[1, 0])  # [count, 2]
    rows = g.op("Gather", ["table", g.op("Gather", [positions, g.const(np.array(1, np.int64))], axis=1)], axis=0)
    projected = g.op("Relu", [g.op("MatMul", [rows, g.weight((16, 8))])])  # [count, 8]
    g.op("ReduceSum", [projected, g.const(np.array([0], np.int64))], out="summary", keepdims=0)
    return g.model("nonzero_gather",
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", 12]),
                    helper.make_tensor_value_info("table", TensorProto.FLOAT, [12, 16])],
                   [helper.make_tensor_value_info("summary", TensorProto.FLOAT, [8])])


def topk_computed_k() -> onnx.ModelProto:
    """TopK whose k is computed from the input's shape (k = length // 4), feeding a softmax."""
    g = _GraphBuilder(seed=7)
    length = g.op("Gather", [g.op("Shape", ["scores"]), g.const(np.array([1], np.int64))])
    k = g.op("Div", [length, g.const(np.array([4], np.int64))])
    values = g.op("TopK", ["scores", k], outputs=2, axis=1)[0]
    g.op("Softmax", [values], out="weights", axis=1)
    return g.model("topk_computed_k",
                   [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", "length"])],
                   [helper.make_tensor_value_info("weights", TensorProto.FLOAT, ["batch", "k"])])


# --- models exported from PyTorch ------------------------------------------------------------------

def _exported_once(build: Callable[..., onnx.ModelProto]) -> Callable[..., onnx.ModelProto]:
    """`build`, a model exported from PyTorch, reading its ONNX file from the user cache
    (user_cache.py) once one process has exported it: a dynamo export takes 4-9 s here, and
    tests, benchmark workers and `tightfit bench --zoo` build the same models in many processes.
    The file's name is a hash of all an export depends on: the builder and its arguments, this
    file's source (the models, their seeds) and the versions of torch, onnxscript (dynamo's
    ONNX writer) and onnx."""
    signature = inspect.signature(build)

    @functools.wraps(build)
    def cached(*args, **kwargs) -> onnx.ModelProto:
        try:
            versions = [importlib.metadata.version(package) for package in ("torch", "onnxscript")]
        except importlib.metadata.PackageNotFoundError:
            return build(*args, **kwargs)  # which says what is missing
        arguments = signature.bind(*args, **kwargs)
        arguments.apply_defaults()
        key = hashlib.sha256(repr((build.__name__, sorted(arguments.arguments.items()), versions,
                                   onnx.__version__)).encode() + Path(__file__).read_bytes())
        path = user_cache.cache_dir() / "zoo" / f"{build.__name__}-{key.hexdigest()[:20]}.onnx"
        try:
            return onnx.load(path)
        except (OSError, DecodeError):
            pass  # not exported yet (or a file cut short by a full disk): export it
        model = build(*args, **kwargs)
        user_cache.write_whole(path, lambda file: file.write(model.SerializeToString()))
        return model

    return cached


def _export(module, example_inputs: tuple, input_names: list[str], output_names: list[str],
            dynamic_axes: dict, dynamo: bool) -> onnx.ModelProto:
    """`module` exported to ONNX in memory, by the TorchScript exporter or by dynamo (torch.export).

    The two write different graphs for the same model: TorchScript folds shape arithmetic into
    Shape/Gather/Concat with Constant nodes, dynamo computes shapes with int64 tensor ops over
    initializers and writes `Shape(start, end)`, `Reshape(allowzero=1)`, opset 18.
    """
    import torch

    with torch.no_grad():
        if dynamo:
            program = torch.onnx.export(module.eval(), example_inputs, input_names=input_names,
                                        output_names=output_names, dynamic_axes=dynamic_axes,
                                        opset_version=DYNAMO_OPSET, dynamo=True, verbose=False)
            return program.model_proto
        buffer = io.BytesIO()
        torch.onnx.export(module.eval(), example_inputs, buffer, input_names=input_names,
                          output_names=output_names, dynamic_axes=dynamic_axes,
                          opset_version=OPSET, dynamo=False)
    return onnx.load_from_string(buffer.getvalue())


def _torch_attention(width: int, heads: int):
    """Multi-head self-attention as exporters see it in most models: softmax(QK^T / sqrt(d)) V,
    with the head split done by reshapes of the run-time shape. (nn.MultiheadAttention's eval-mode
    fast path, aten::_native_multi_head_attention, has no ONNX export.)"""
    from torch import nn

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

        def forward(self, x):
            batch, length, _ = x.shape
            q, k, v = self.qkv(x).reshape(batch, length, 3, heads, width // heads).permute(2, 0, 3, 1, 4)
            scores = q @ k.transpose(-2, -1) / (x.shape[-1] // heads) ** 0.5
            mixed = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, length, width)
            return self.out(mixed)

    return Attention()


@_exported_once
def transformer_encoder(dynamo: bool = False, width: int = 32, heads: int = 4,
                        mlp_ratio: int = 2) -> onnx.ModelProto:
    """Two pre-norm encoder layers (multi-head self-attention, GELU MLP of `mlp_ratio` x width)
    over token embeddings; batch and sequence length are dynamic."""
    import torch
    from torch import nn

    torch.manual_seed(0)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.attention = _torch_attention(width, heads)
            self.mlp = nn.Sequential(nn.Linear(width, mlp_ratio * width), nn.GELU(),
                                     nn.Linear(mlp_ratio * width, width))

        def forward(self, x):
            x = x + self.attention(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(100, width)
            self.layers = nn.Sequential(Layer(), Layer())

        def forward(self, tokens):
            return self.layers(self.embed(tokens))

    tokens = torch.randint(0, 100, (2, 7))
    return _export(Encoder(), (tokens,), ["tokens"], ["hidden"],
                   {"tokens": {0: "batch", 1: "sequence"}, "hidden": {0: "batch", 1: "sequence"}}, dynamo)


def _token_feeds(shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    return {"tokens": np.random.default_rng(sum(shapes["tokens"])).integers(0, 100, shapes["tokens"])}


@_exported_once
def detector_fpn(dynamo: bool = False) -> onnx.ModelProto:
    """A detector-style neck: a strided backbone, the coarse map upsampled to the size of the fine
    one (F.interpolate with size= taken from a tensor's shape) and by scale factor 2, concatenated
    and fed to a per-pixel head. Height and width are dynamic (multiples of 4)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(1)

    class Neck(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
            self.down = nn.Conv2d(8, 16, 3, stride=2, padding=1)
            self.lateral = nn.Conv2d(16, 8, 1)
            self.head = nn.Conv2d(24, 6, 3, padding=1)

        def forward(self, image):
            fine = F.relu(self.stem(image))
            coarse = F.relu(self.down(fine))
            to_fine = F.interpolate(self.lateral(coarse), size=fine.shape[-2:], mode="nearest")
            doubled = F.interpolate(coarse, scale_factor=2.0, mode="nearest")
            return self.head(torch.cat([to_fine, doubled], dim=1))

    image = torch.randn(1, 3, 32, 48)
    return _export(Neck(), (image,), ["image"], ["boxes"],
                   {"image": {0: "batch", 2: "height", 3: "width"}, "boxes": {0: "batch", 2: "out_h", 3: "out_w"}},
                   dynamo)


@_exported_once
def speech_encoder(dynamo: bool = False) -> onnx.ModelProto:
    """A speech-style encoder: two stride-2 conv1d layers subsample 40-bin features over time, then
    one self-attention layer with a residual; batch and time are dynamic."""
    import torch
    from torch import nn

    torch.manual_seed(2)

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.subsample = nn.Sequential(nn.Conv1d(40, 32, 3, stride=2, padding=1), nn.ReLU(),
                                           nn.Conv1d(32, 32, 3, stride=2, padding=1), nn.ReLU())
            self.attention = _torch_attention(32, 4)
            self.norm = nn.LayerNorm(32)

        def forward(self, features):  # [batch, time, 40]
            x = self.subsample(features.transpose(1, 2)).transpose(1, 2)
            return self.norm(x + self.attention(x))

    features = torch.randn(2, 50, 40)
    return _export(Encoder(), (features,), ["features"], ["encoded"],
                   {"features": {0: "batch", 1: "time"}, "encoded": {0: "batch", 1: "frames"}}, dynamo)


@_exported_once
def torch_transformer_layers() -> onnx.ModelProto:
    """PyTorch's own nn.TransformerEncoder (two post-norm layers, batch first), which only the
    dynamo exporter can export in eval mode (TorchScript has no ONNX form of its fused
    aten::_transformer_encoder_layer_fwd); batch and sequence length are dynamic."""
    import torch
    from torch import nn

    torch.manual_seed(3)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    x = torch.randn(2, 7, 32)
    return _export(encoder, (x,), ["x"], ["y"], {"x": {0: "batch", 1: "sequence"}}, dynamo=True)


@_exported_once
def bert_encoder() -> onnx.ModelProto:
    """BERT's encoder as Hugging Face writes it (two post-norm layers of width 32, 4 heads of 8,
    GELU MLP of 64), exported by dynamo: separate Q, K and V projections, each reshaped to
    heads and transposed, and the padding mask turned into an added one, (1 - mask) x -10000
    broadcast over heads and queries. Batch and sequence length are dynamic."""
    import torch
    from torch import nn

    torch.manual_seed(5)
    width, heads = 32, 4

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.query, self.key, self.value, self.output = (nn.Linear(width, width)
                                                             for _ in range(4))
            self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                     nn.Linear(2 * width, width))

        def split(self, x):
            batch, length, _ = x.shape
            return x.reshape(batch, length, heads, width // heads).transpose(1, 2)

        def forward(self, x, added_mask):
            q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
            scores = q @ k.transpose(-1, -2) / (width // heads) ** 0.5 + added_mask
            mixed = (scores.softmax(-1) @ v).transpose(1, 2).reshape(x.shape)
            x = self.norm1(x + self.output(mixed))
            return self.norm2(x + self.mlp(x))

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(100, width)
            self.layers = nn.ModuleList([Layer(), Layer()])

        def forward(self, tokens, mask):
            added_mask = (1.0 - mask[:, None, None, :].float()) * -10000.0
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x, added_mask)
            return x

    tokens, mask = torch.randint(0, 100, (2, 7)), torch.ones(2, 7, dtype=torch.int64)
    axes = {0: "batch", 1: "sequence"}
    return _export(Encoder(), (tokens, mask), ["tokens", "mask"], ["hidden"],
                   {"tokens": axes, "mask": axes, "hidden": axes}, dynamo=True)


def _padded_token_feeds(shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Token ids, and a padding mask whose entry b keeps the first sequence - b tokens (at least
    one)."""
    batch, length = shapes["tokens"]
    kept = np.maximum(length - np.arange(batch), 1)
    return {**_token_feeds(shapes),
            "mask": (np.arange(length)[None, :] < kept[:, None]).astype(np.int64)}


@_exported_once
def mobilenet_v2() -> onnx.ModelProto:
    """MobileNetV2 at full size (width 1.0, Sandler et al. 2018, torchvision's layer table:
    3.5 M parameters, 0.3 GMAC at 224 x 224) with random weights and batch-norm statistics:
    the zoo's one model of a real network's size, whose 1x1 convs at 14 x 14 and 7 x 7 and
    112 x 112 activations the small models do not have. Batch, height and width are dynamic."""
    import torch
    from torch import nn

    torch.manual_seed(4)

    def conv_bn_relu6(in_channels, out_channels, kernel=3, stride=1, groups=1):
        return nn.Sequential(nn.Conv2d(in_channels, out_channels, kernel, stride, kernel // 2,
                                       groups=groups, bias=False),
                             nn.BatchNorm2d(out_channels), nn.ReLU6())

    class InvertedResidual(nn.Module):
        def __init__(self, in_channels, out_channels, stride, expansion):
            super().__init__()
            hidden = in_channels * expansion
            expand = [conv_bn_relu6(in_channels, hidden, 1)] if expansion != 1 else []
            self.body = nn.Sequential(*expand, conv_bn_relu6(hidden, hidden, 3, stride, hidden),
                                      nn.Conv2d(hidden, out_channels, 1, bias=False),
                                      nn.BatchNorm2d(out_channels))
            self.residual = stride == 1 and in_channels == out_channels

        def forward(self, x):
            return x + self.body(x) if self.residual else self.body(x)

    class MobileNetV2(nn.Module):
        # (expansion, out channels, repeats, first stride) per stage
        STAGES = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                  (6, 160, 3, 2), (6, 320, 1, 1)]

        def __init__(self):
            super().__init__()
            layers, channels = [conv_bn_relu6(3, 32, 3, 2)], 32
            for expansion, out_channels, repeats, stride in self.STAGES:
                for index in range(repeats):
                    layers.append(InvertedResidual(channels, out_channels,
                                                   stride if index == 0 else 1, expansion))
                    channels = out_channels
            self.features = nn.Sequential(*layers, conv_bn_relu6(channels, 1280, 1))
            self.classifier = nn.Linear(1280, 1000)

        def forward(self, image):
            return self.classifier(self.features(image).mean((2, 3)))

    model = MobileNetV2()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):  # trained-looking statistics, not 0 and 1
            module.running_mean.uniform_(-0.1, 0.1)
            module.running_var.uniform_(0.5, 1.5)
    return _export(model, (torch.randn(1, 3, 224, 224),), ["image"], ["logits"],
                   {"image": {0: "batch", 2: "height", 3: "width"}}, dynamo=False)


# --- the registry ----------------------------------------------------------------------------------

_MODELS = [
    ZooModel(name="resnet_style", build=resnet_style, feeds=None, dynamic=True,
             shape_sets=[{"image": (1, 3, 32, 32)}, {"image": (4, 3, 32, 32)}],
             description="ResNet-style CNN, dynamic batch"),
    ZooModel(name="mobilenet_v2_style", build=convnet_dynamic, feeds=None, dynamic=True,
             shape_sets=[{"image": (1, 3, 64, 64)}, {"image": (2, 3, 96, 80)}],
             description="MobileNetV2-style inverted residual blocks, dynamic batch/H/W"),
    ZooModel(name="conv_dynamic_hw", build=conv_dynamic_hw, feeds=None, dynamic=True,
             shape_sets=[{"image": (1, 3, 32, 32)}, {"image": (1, 3, 45, 61)}, {"image": (1, 3, 64, 20)}],
             description="fully convolutional net, dynamic H/W"),
    ZooModel(name="grouped_convnet", build=grouped_convnet, feeds=None, dynamic=True,
             shape_sets=[{"image": (1, 3, 96, 96)}, {"image": (2, 3, 64, 80)}],
             description="ShuffleNet units and a ResNeXt bottleneck: grouped convs, channel "
                         "shuffle; dynamic batch/H/W"),
    ZooModel(name="gated_skip_block", build=gated_skip_block, feeds=_signed_feeds, dynamic=True,
             shape_sets=[{"x": (2, 8, 16, 16)}, {"x": (1, 8, 16, 16)}, {"x": (3, 8, 16, 16)}],
             description="If on a data-dependent gate (both branches exercised)"),
    ZooModel(name="nonzero_gather", build=nonzero_gather, feeds=None, dynamic=True,
             shape_sets=[{"x": (4, 12), "table": (12, 16)}, {"x": (9, 12), "table": (12, 16)}],
             description="NonZero feeding Gather/MatMul: data-dependent row count"),
    ZooModel(name="topk_computed_k", build=topk_computed_k, feeds=None, dynamic=True,
             shape_sets=[{"scores": (2, 16)}, {"scores": (3, 40)}],
             description="TopK with k computed from the input shape"),
    ZooModel(name="transformer_encoder", build=transformer_encoder, feeds=_token_feeds, dynamic=True,
             shape_sets=[{"tokens": (1, 5)}, {"tokens": (3, 16)}, {"tokens": (2, 33)}],
             description="PyTorch transformer encoder, dynamic batch and sequence"),
    ZooModel(name="detector_fpn", build=detector_fpn, feeds=None, dynamic=True,
             shape_sets=[{"image": (1, 3, 32, 48)}, {"image": (2, 3, 64, 40)}],
             description="PyTorch detector neck: interpolate to a computed size, concat"),
    ZooModel(name="speech_encoder", build=speech_encoder, feeds=None, dynamic=True,
             shape_sets=[{"features": (1, 40, 40)}, {"features": (2, 77, 40)}],
             description="PyTorch conv1d subsampling + attention, dynamic batch and time"),
    # The same PyTorch models through the dynamo exporter, whose graphs differ (see _export).
    ZooModel(name="transformer_encoder_dynamo", build=partial(transformer_encoder, dynamo=True),
             feeds=_token_feeds, dynamic=True,
             shape_sets=[{"tokens": (1, 5)}, {"tokens": (3, 16)}],
             description="transformer_encoder exported by dynamo"),
    ZooModel(name="transformer_encoder_wide",
             build=partial(transformer_encoder, dynamo=True, width=256, heads=4, mlp_ratio=4),
             feeds=_token_feeds, dynamic=True,
             shape_sets=[{"tokens": (1, 128)}, {"tokens": (4, 32)}],
             description="transformer_encoder_dynamo at a real model's layer sizes (BERT-mini's: "
                         "256 wide, 4 heads of 64, MLP 1024)"),
    ZooModel(name="detector_fpn_dynamo", build=partial(detector_fpn, dynamo=True), feeds=None,
             dynamic=True, shape_sets=[{"image": (1, 3, 32, 48)}, {"image": (2, 3, 64, 40)}],
             description="detector_fpn exported by dynamo"),
    ZooModel(name="speech_encoder_dynamo", build=partial(speech_encoder, dynamo=True), feeds=None,
             dynamic=True, shape_sets=[{"features": (1, 40, 40)}, {"features": (2, 77, 40)}],
             description="speech_encoder exported by dynamo: frame count by truncating int Div"),
    ZooModel(name="torch_transformer_layers", build=torch_transformer_layers, feeds=None,
             dynamic=True, shape_sets=[{"x": (1, 5, 32)}, {"x": (3, 12, 32)}],
             description="PyTorch nn.TransformerEncoder (fused MHA) exported by dynamo"),
    ZooModel(name="bert_encoder", build=bert_encoder, feeds=_padded_token_feeds, dynamic=True,
             shape_sets=[{"tokens": (1, 5), "mask": (1, 5)}, {"tokens": (3, 16), "mask": (3, 16)}],
             description="BERT-style encoder (separate Q/K/V, padding mask) exported by dynamo"),
    ZooModel(name="mobilenet_v2", build=mobilenet_v2, feeds=None, dynamic=True,
             shape_sets=[{"image": (1, 3, 224, 224)}, {"image": (2, 3, 160, 128)}],
             description="MobileNetV2 at full size (3.5 M parameters), dynamic batch/H/W"),
    ZooModel(name="resnet18", build=resnet18, feeds=None, dynamic=True,
             shape_sets=[{"image": (1, 3, 128, 128)}, {"image": (2, 3, 96, 112)}],
             description="ResNet-18 at full size (11.7 M parameters), dynamic batch/H/W"),
]
# Cases where RDP's backward propagation and Merge matter (rdp_cases.py says what each shows).
_MODELS += [
    ZooModel(name="reshape_to_computed_shape", build=rdp_cases.reshape_to_computed_shape, feeds=None,
             dynamic=True, shape_sets=[{"x": (1, 4, 16)}, {"x": (3, 10, 16)}],
             description="Reshape to targets computed from the input's shape"),
    ZooModel(name="nonzero_rows_tied", build=rdp_cases.nonzero_rows_tied, feeds=None, dynamic=True,
             shape_sets=[{"x": (3, 4), "v": (3, 8)}, {"x": (7, 4), "v": (7, 8)}],
             description="NonZero count tied to an input dim by MatMul"),
    ZooModel(name="if_same_symbolic_shape", build=rdp_cases.if_same_symbolic_shape, feeds=_signed_feeds,
             dynamic=True, shape_sets=[{"x": (2, 6)}, {"x": (1, 6)}, {"x": (3, 6)}],
             description="If whose branches give the same symbolic shape"),
    ZooModel(name="if_different_shapes", build=rdp_cases.if_different_shapes, feeds=_signed_feeds,
             dynamic=True, shape_sets=[{"x": (2, 6)}, {"x": (1, 6)}, {"x": (3, 6)}],
             description="If whose branches give different shapes (data-dependent dim)"),
]
_BY_NAME = {model.name: model for model in _MODELS}


def names() -> list[str]:
    """The zoo's model names, in a fixed order."""
    return [model.name for model in _MODELS]


def get(name: str) -> ZooModel:
    """The zoo entry called `name`; KeyError listing the names if there is none."""
    if name not in _BY_NAME:
        raise KeyError(f"no zoo model {name!r}; the zoo has {', '.join(names())}")
    return _BY_NAME[name]
