"""The memory-bound kernels alone: softmax and layer norm (schedules/row_kernels.py) and max
pooling (schedules/pool_kernels.py), tightfit's kernel against TOPI's with the fallback schedule
(what a build without fast kernels runs), at the zoo's shapes.

Each op is a one-node model compiled both ways; the two sessions take turns, and a turn times
the kernel alone (Session.profile: the kernel's own calls, no VM or Python around them). The
table gives each side's minimum and median over the turns and the median of the per-turn
ratios, which a busy machine disturbs least. Usage:
    .venv/bin/python bench/memory_bound_kernels.py [turns]
"""

import statistics
import sys

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import tightfit
from tightfit.pipeline import PipelineOptions

# (name, model, input shapes): attention's scores over 5, 16, 33 and 128 tokens; a
# transformer's layer norms; conv_dynamic_hw's and a ResNet stem's pools
CASES = [
    ("softmax", "softmax", [(1, 4, 5, 5), (3, 4, 16, 16), (2, 4, 33, 33), (1, 4, 128, 128)]),
    ("layer norm", "layer_norm", [(1, 5, 32), (3, 16, 32), (1, 128, 256)]),
    ("max pool 2x2/2", "pool_2x2", [(1, 12, 32, 32), (1, 12, 45, 61)]),
    ("max pool 3x3/2 pad 1", "pool_3x3", [(1, 64, 64, 64), (1, 64, 112, 112), (2, 24, 48, 48)]),
]


def one_node_model(kind: str, width: int | None):
    """The op over symbolic dims (a layer norm's last, `width`, fixed by its gamma and beta)."""
    dims = ["n", "c", "h", "w"]
    initializers = []
    if kind == "softmax":
        node = helper.make_node("Softmax", ["x"], ["y"], axis=-1)
    elif kind == "layer_norm":
        dims = ["n", "s", width]
        node = helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["y"], axis=-1)
        rng = np.random.default_rng(0)
        initializers = [numpy_helper.from_array(rng.standard_normal(width).astype(np.float32),
                                                name) for name in ("gamma", "beta")]
    else:
        size, pad = (2, 0) if kind == "pool_2x2" else (3, 1)
        node = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[size, size],
                                strides=[2, 2], pads=[pad] * 4)
    out_dims = dims if kind in ("softmax", "layer_norm") else ["n", "c", "oh", "ow"]
    graph = helper.make_graph(
        [node], kind, [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_dims)], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def kernel_seconds(session, feeds) -> float:
    """The op's kernel alone: the longest of the run's kernels (the others compute shapes)."""
    return max(kernel.seconds for kernel in session.profile(feeds).kernels)


def main(turns: int) -> None:
    print("| op | shape | tightfit us (min / median) | TOPI + fallback us (min / median) | "
          "median ratio |")
    print("|---|---|---|---|---|")
    for label, kind, shapes in CASES:
        compiled = {}
        for shape in shapes:
            width = shape[-1] if kind == "layer_norm" else None
            if width not in compiled:
                model = one_node_model(kind, width)
                compiled[width] = [tightfit.compile(model, options=PipelineOptions(
                    fast_kernels=fast)).session() for fast in (True, False)]
            fast, fallback = compiled[width]
            feeds = {"x": np.random.default_rng(1).standard_normal(shape).astype(np.float32)}
            np.testing.assert_allclose(fast.run(feeds)["y"], fallback.run(feeds)["y"],
                                       rtol=1e-4, atol=1e-5)
            times = [(kernel_seconds(fast, feeds), kernel_seconds(fallback, feeds))
                     for _ in range(turns)]
            ours, theirs = ([pair[side] * 1e6 for pair in times] for side in (0, 1))
            ratio = statistics.median(mine / other for mine, other in times)
            print(f"| {label} | {'x'.join(map(str, shape))} | {min(ours):.2f} / "
                  f"{statistics.median(ours):.2f} | {min(theirs):.2f} / "
                  f"{statistics.median(theirs):.2f} | {ratio:.3f} |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
