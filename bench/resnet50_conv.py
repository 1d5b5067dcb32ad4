"""ResNet-50's 3x3 conv (n x 64 x 56 x 56 -> 64, pad 1, bias, ReLU): tightfit against onnxruntime.

The roofline case of issue 5 (its MetaSchedule figure: 0.61 ms = 376 GFLOP/s, onnxruntime
0.96 ms, batch 1). Both engines run in this process, taking turns; the median of their timed
runs gives GFLOP/s (2 x multiply-adds per second). tightfit's VM-only time (no Python input
copy) is printed beside it. Usage: .venv/bin/python bench/resnet50_conv.py [batch] [knob database]
"""

import statistics
import sys
import time

import numpy as np
import onnxruntime
from onnx import TensorProto, helper, numpy_helper

import tightfit
from tightfit.pipeline import PipelineOptions

TURNS = 6
RUNS_PER_TURN = 10


def conv_model():
    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array((rng.standard_normal((64, 64, 3, 3)) * 0.05).astype(np.float32), "w")
    bias = numpy_helper.from_array(rng.standard_normal(64).astype(np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["y"])], "resnet50_conv3x3",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64, 56, 56])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 64, 56, 56])], [weight, bias])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def main(batch: int, knob_database: str | None) -> None:
    model = conv_model()
    x = np.random.default_rng(1).standard_normal((batch, 64, 56, 56)).astype(np.float32)
    session = tightfit.compile(model, options=PipelineOptions(knob_database=knob_database)).session()
    reference = onnxruntime.InferenceSession(model.SerializeToString(),
                                             providers=["CPUExecutionProvider"])
    error = float(np.abs(session.run({"x": x})["y"] - reference.run(None, {"x": x})[0]).max())
    engines = {"tightfit": lambda: session.run({"x": x}),
               "onnxruntime": lambda: reference.run(None, {"x": x})}
    samples = {name: [] for name in engines}
    for _ in range(TURNS):
        for name, run in engines.items():
            time.sleep(0.05)
            run()
            for _ in range(RUNS_PER_TURN):
                started = time.perf_counter()
                run()
                samples[name].append(time.perf_counter() - started)
    flops = 2 * batch * 56 * 56 * 64 * 64 * 9
    vm_seconds = statistics.median(session.time_run({"x": x}, number=5, repeat=10))
    print(f"max abs error vs onnxruntime: {error:.1e}")
    for name, values in samples.items():
        seconds = statistics.median(values)
        print(f"{name}: {seconds * 1e3:.3f} ms, {flops / seconds / 1e9:.0f} GFLOP/s")
    print(f"tightfit VM only: {vm_seconds * 1e3:.3f} ms, {flops / vm_seconds / 1e9:.0f} GFLOP/s")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1, sys.argv[2] if len(sys.argv) > 2 else None)
