"""Roofline view: the largest conv and GEMM of each zoo model, timed alone, against this CPU's
measured compute peak and memory bandwidth (issue 5's report).

The roofline model (Williams, Waterman and Patterson, CACM 2009): a kernel that does F FLOPs and
must move at least B bytes (its inputs, weights and output, once each) has arithmetic intensity
I = F / B and cannot run faster than min(peak FLOP/s, I x memory bandwidth). Both ceilings are
measured here, by kernels that TVM builds for the same target as tightfit:
- peak: FMA_CHAINS independent chains of fused multiply-adds per thread in the target's widest
  vectors, one set per thread of TVM's pool, all in parallel. It is cores x FMA pipes x fp32 lanes
  (16 with AVX-512, 8 with AVX2, 4 with NEON) x 2 FLOP x the clock under load, which is what the
  measurement adds to that formula (the clock /proc/cpuinfo states is the base clock, not the
  turbo one);
- memory bandwidth: a parallel vector scale of a STREAM_BYTES array into another, bytes read
  plus bytes written, so both arrays are far larger than any cache.
The layers: each zoo model's largest Conv and largest MatMul/Gemm by FLOPs, at the zoo shape set
with the most input elements, cut out of the model as a one-node ONNX model whose inputs are the
values the whole model gives that node (recorded by running the model in onnxruntime; weights stay
initializers). Only the top-level graph is searched: a node inside an If branch is not a
candidate. With the whole zoo, REFERENCE_LAYERS at real networks' sizes are timed too, ResNet-50's
3x3 conv (the issue's case) and a BERT-base feed-forward GEMM: the zoo's transformers are small.
Each layer is timed by `bench.benchmark_model`, the three engines taking turns in one run. Most
zoo layers fit in the L2 cache, so they can run above the DRAM roof; for them the peak is the
ceiling that counts.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .bench import ENGINES, _fmt, benchmark_model, tvm_pool_threads

FMA_CHAINS = 12  # two FMA pipes x four cycles of latency need 8 chains in flight; 12 leaves margin
FMA_ITERATIONS = 2_000_000
STREAM_BYTES = 256 * 2**20
CEILING_REPEATS = 5
GEMM_OPS = ("MatMul", "Gemm")


@dataclass
class Ceilings:
    peak_gflops: float
    bandwidth_gbs: float
    threads: int
    vector_lanes: int

    def bound_gflops(self, intensity: float) -> float:
        return min(self.peak_gflops, intensity * self.bandwidth_gbs)


@dataclass
class Layer:
    """One node cut out of a model: a one-node ONNX model and the inputs the model gives it."""

    source: str  # the zoo model (or "reference")
    description: str  # op, node name and shapes
    model: onnx.ModelProto
    feeds: dict[str, np.ndarray]
    flops: int
    min_bytes: int


@dataclass
class LayerResult:
    source: str
    description: str
    flops: int
    min_bytes: int
    median_ms: dict[str, float] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    max_abs_error: float | None = None

    @property
    def intensity(self) -> float:
        return self.flops / self.min_bytes

    def gflops(self, engine: str) -> float | None:
        ms = self.median_ms.get(engine)
        return None if ms is None else self.flops / (ms * 1e-3) / 1e9


@dataclass
class RooflineReport:
    ceilings: Ceilings
    layers: list[LayerResult]


# --- the ceilings ----------------------------------------------------------------------------

def measure_ceilings() -> Ceilings:
    """Peak FLOP/s and memory bandwidth of this host, with TVM's pool as tightfit runs it."""
    import tvm

    from .schedules.isa import isa_for_target
    from .target import resolve_target

    target = resolve_target("host").tvm_target
    threads = tvm_pool_threads()
    lanes = isa_for_target(target).lanes
    device = tvm.cpu()

    fma = tvm.compile(fma_chains_kernel(threads, lanes), target)
    seeds = tvm.runtime.tensor(np.ones((threads, FMA_CHAINS, lanes), np.float32), device)
    results = tvm.runtime.tensor(np.zeros((threads, FMA_CHAINS, lanes), np.float32), device)
    seconds = _best_time(fma, "fma_chains", seeds, results, FMA_ITERATIONS)
    peak = 2 * threads * FMA_CHAINS * lanes * FMA_ITERATIONS / seconds

    elements = STREAM_BYTES // 4
    scale = tvm.compile(stream_scale_kernel(threads, lanes, elements), target)
    source = tvm.runtime.tensor(np.ones(elements, np.float32), device)
    destination = tvm.runtime.tensor(np.empty(elements, np.float32), device)
    seconds = _best_time(scale, "stream_scale", source, destination)
    bandwidth = 2 * STREAM_BYTES / seconds
    return Ceilings(round(peak / 1e9, 1), round(bandwidth / 1e9, 1), threads, lanes)


def fma_chains_kernel(threads: int, lanes: int):
    """results[t] = FMA_CHAINS vectors, each `seeds[t]` put through `iterations` steps of
    acc = fma(acc, 0.999, 0.001): every step of every chain is one vector FMA, and the chains are
    independent, so the FMA pipes never wait on a result."""
    from tvm.script import tirx as T

    @T.prim_func
    def fma_chains(seeds: T.Buffer((threads, FMA_CHAINS, lanes), "float32"),
                   results: T.Buffer((threads, FMA_CHAINS, lanes), "float32"), iterations: T.int32):
        for thread in T.parallel(threads):
            # Small, constant-size and global-scope: a stack array, which LLVM keeps in registers
            # (schedules/isa.py).
            acc = T.decl_buffer((FMA_CHAINS, lanes), "float32")
            for chain in T.unroll(FMA_CHAINS):
                for lane in T.vectorized(lanes):
                    acc[chain, lane] = seeds[thread, chain, lane]
            for _ in range(iterations):
                for chain in T.unroll(FMA_CHAINS):
                    for lane in T.vectorized(lanes):
                        acc[chain, lane] = T.fma(acc[chain, lane], T.float32(0.999), T.float32(0.001))
            for chain in T.unroll(FMA_CHAINS):
                for lane in T.vectorized(lanes):
                    results[thread, chain, lane] = acc[chain, lane]

    return fma_chains


def stream_scale_kernel(threads: int, lanes: int, elements: int):
    """destination = 2 x source, split in `threads` contiguous parts, in whole vectors."""
    from tvm.script import tirx as T

    vectors_per_thread = elements // (threads * lanes)

    @T.prim_func
    def stream_scale(source: T.Buffer((elements,), "float32"),
                     destination: T.Buffer((elements,), "float32")):
        for thread in T.parallel(threads):
            for vector in range(vectors_per_thread):
                for lane in T.vectorized(lanes):
                    # written out twice: a let-bound index inside the vectorized loop was
                    # vectorized wrong (one lane of each vector stored)
                    destination[(thread * vectors_per_thread + vector) * lanes + lane] = (
                        source[(thread * vectors_per_thread + vector) * lanes + lane] * T.float32(2))

    return stream_scale


def _best_time(executable, name: str, *arguments) -> float:
    """The fastest of CEILING_REPEATS runs: a ceiling is what the machine can do at best."""
    import tvm

    timer = executable.mod.time_evaluator(name, tvm.cpu(), number=1, repeat=CEILING_REPEATS)
    return min(timer(*arguments).results)


# --- the layers ------------------------------------------------------------------------------

def layer_flops(node: onnx.NodeProto, shapes: dict[str, tuple[int, ...]]) -> int:
    """FLOPs of a Conv, MatMul or Gemm node: 2 per multiply-add (bias adds not counted)."""
    output = shapes[node.output[0]]
    if node.op_type == "Conv":
        weight = shapes[node.input[1]]  # (C_out, C_in / group, *kernel)
        return 2 * int(np.prod(output)) * int(np.prod(weight[1:]))
    if node.op_type == "MatMul":
        a = shapes[node.input[0]]
        return 2 * int(np.prod(output)) * a[-1]
    if node.op_type == "Gemm":
        a = shapes[node.input[0]]
        trans_a = next((attr.i for attr in node.attribute if attr.name == "transA"), 0)
        return 2 * int(np.prod(output)) * (a[0] if trans_a else a[1])
    raise ValueError(f"no FLOP count for {node.op_type}")


def largest_layers(source: str, proto: onnx.ModelProto,
                   feeds: dict[str, np.ndarray]) -> list[Layer]:
    """The largest Conv and the largest MatMul/Gemm of `proto` at `feeds`, each as a Layer."""
    candidates = [n for n in proto.graph.node if n.op_type == "Conv" or n.op_type in GEMM_OPS]
    if not candidates:
        return []
    values = _intermediate_values(proto, feeds, {name for n in candidates
                                                 for name in [*n.input, *n.output] if name})
    shapes = {name: value.shape for name, value in values.items()}
    layers = []
    for kind in (("Conv",), GEMM_OPS):
        of_kind = [n for n in candidates if n.op_type in kind]
        if of_kind:
            node = max(of_kind, key=lambda n: layer_flops(n, shapes))  # the first of equals
            layers.append(_cut_out(source, node, proto, values, layer_flops(node, shapes)))
    return layers


def _intermediate_values(proto: onnx.ModelProto, feeds: dict[str, np.ndarray],
                         names: set[str]) -> dict[str, np.ndarray]:
    """The value of every tensor in `names` when onnxruntime runs `proto` on `feeds`."""
    import onnxruntime

    initializers = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    probed = onnx.ModelProto()
    probed.CopyFrom(proto)
    declared = {output.name for output in probed.graph.output}
    for name in sorted(names - declared - set(initializers) - set(feeds)):
        # Any element type will do: onnxruntime reads the real one from the graph.
        probed.graph.output.append(helper.make_empty_tensor_value_info(name))
    session = onnxruntime.InferenceSession(probed.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    output_names = [output.name for output in session.get_outputs()]
    values = dict(zip(output_names, session.run(output_names, feeds)))
    return {**initializers, **feeds, **values}


def _cut_out(source: str, node: onnx.NodeProto, proto: onnx.ModelProto,
             values: dict[str, np.ndarray], flops: int) -> Layer:
    constants = {t.name for t in proto.graph.initializer}
    constants |= {o for n in proto.graph.node if n.op_type == "Constant" for o in n.output}
    inputs = [name for name in node.input if name]
    weights = [numpy_helper.from_array(values[name], name) for name in inputs if name in constants]
    feeds = {name: values[name] for name in inputs if name not in constants}
    output = values[node.output[0]]
    graph = helper.make_graph(
        [helper.make_node(node.op_type, list(node.input), [node.output[0]], name=node.name or None,
                          domain=node.domain or None, **{a.name: helper.get_attribute_value(a)
                                                         for a in node.attribute})],
        f"{source}.{node.name or node.op_type}",
        [helper.make_tensor_value_info(name, _onnx_type(value), value.shape)
         for name, value in feeds.items()],
        [helper.make_tensor_value_info(node.output[0], _onnx_type(output), output.shape)],
        weights)
    model = helper.make_model(graph, opset_imports=list(proto.opset_import))
    shapes = " x ".join("x".join(map(str, values[name].shape)) for name in inputs)
    description = f"{node.op_type} {node.name} ({shapes} -> {'x'.join(map(str, output.shape))})"
    min_bytes = sum(values[name].nbytes for name in inputs) + output.nbytes
    return Layer(source, description, model, feeds, flops, min_bytes)


def _onnx_type(value: np.ndarray) -> int:
    return helper.np_dtype_to_tensor_dtype(value.dtype)


def reference_layers() -> list[Layer]:
    """Layers at real networks' sizes, batch 1: ResNet-50's 3x3 conv of its first stage
    (1x64x56x56 -> 64, pad 1) and BERT-base's feed-forward up-projection (128 tokens x 768 ->
    3072)."""
    rng = np.random.default_rng(0)
    conv = helper.make_node("Conv", ["x", "w"], ["y"], name="resnet50_layer1_conv3x3",
                            kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    matmul = helper.make_node("MatMul", ["x", "w"], ["y"], name="bert_base_ffn_up")
    cases = [(conv, (1, 64, 56, 56), (64, 64, 3, 3), (1, 64, 56, 56)),
             (matmul, (1, 128, 768), (768, 3072), (1, 128, 3072))]
    layers = []
    for node, x_shape, w_shape, y_shape in cases:
        weight = (rng.standard_normal(w_shape) * 0.05).astype(np.float32)
        x = rng.standard_normal(x_shape).astype(np.float32)
        y = np.zeros(y_shape, np.float32)
        proto = helper.make_model(helper.make_graph(
            [node], node.name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
            [numpy_helper.from_array(weight, "w")]), opset_imports=[helper.make_opsetid("", 17)])
        shapes = {"x": x_shape, "w": w_shape, "y": y_shape}
        layers.append(_cut_out("reference", node, proto, {"x": x, "w": weight, "y": y},
                               layer_flops(node, shapes)))
    return layers


# --- the benchmark and its report ------------------------------------------------------------

def benchmark_roofline(layers: list[Layer], repeat: int = 16) -> RooflineReport:
    """Time every layer in the three engines, after measuring the ceilings."""
    from tqdm import tqdm

    ceilings = measure_ceilings()
    results = []
    for layer in tqdm(layers, desc="roofline", unit="layer", file=sys.stderr, disable=None):
        timing = benchmark_model(layer.model, [{n: v.shape for n, v in layer.feeds.items()}],
                                 name=layer.description, repeat=repeat, measure_memory=False,
                                 feeds_for=lambda shapes, feeds=layer.feeds: feeds)
        measured = timing.shapes[0] if timing.shapes else None
        results.append(LayerResult(layer.source, layer.description, layer.flops, layer.min_bytes,
                                   dict(measured.median_ms) if measured else {},
                                   dict(timing.failures),
                                   measured.max_abs_error if measured else None))
    return RooflineReport(ceilings, results)


def roofline_table(report: RooflineReport) -> str:
    ceilings = report.ceilings
    lines = ["| # | model | layer | MFLOP | FLOP/byte | roof GFLOP/s | "
             + " | ".join(f"{engine} ms" for engine in ENGINES) + " | "
             + " | ".join(f"{engine} GFLOP/s (% peak)" for engine in ENGINES) + " | max abs err |",
             "|" + "---|" * (7 + 2 * len(ENGINES))]
    for index, layer in enumerate(report.layers, 1):
        intensity = layer.intensity
        times = [_fmt(layer.median_ms.get(engine)) for engine in ENGINES]
        rates = []
        for engine in ENGINES:
            rate = layer.gflops(engine)
            rates.append("-" if rate is None else
                         f"{_fmt(rate)} ({100 * rate / ceilings.peak_gflops:.0f}%)")
        error = "-" if layer.max_abs_error is None else f"{layer.max_abs_error:.1e}"
        lines.append(f"| {index} | {layer.source} | {layer.description} | {layer.flops / 1e6:.3g} | "
                     f"{intensity:.3g} | {_fmt(ceilings.bound_gflops(intensity))} | "
                     + " | ".join(times + rates) + f" | {error} |")
    failures = [f"- {layer.description} / {engine}: {why}"
                for layer in report.layers for engine, why in layer.failures.items()]
    lines += ["", "Failures:", *failures] if failures else []
    lines += ["", f"Ceilings, measured in this run with TVM's pool of {ceilings.threads} threads: "
              f"peak {ceilings.peak_gflops:g} GFLOP/s ({FMA_CHAINS} independent FMA chains of "
              f"{ceilings.vector_lanes} fp32 lanes per thread), memory bandwidth "
              f"{ceilings.bandwidth_gbs:g} GB/s (a {STREAM_BYTES >> 20} MB array scaled into "
              "another, bytes read plus written). roof = min(peak, FLOP/byte x bandwidth), where "
              "FLOP/byte counts each input, weight and output once. FLOPs are the direct "
              "algorithm's: a conv that runs as Winograd does fewer multiplies, and can pass 100% "
              "of peak. Times are medians of whole runs from Python, engines taking turns "
              "(bench.benchmark_model)."]
    return "\n".join(lines)


def write_roofline_reports(report: RooflineReport, directory: str | Path) -> list[Path]:
    """roofline.json, roofline.md and, where matplotlib is installed, roofline.png."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    json_path = directory / "roofline.json"
    json_path.write_text(json.dumps(asdict(report), indent=2))
    markdown_path = directory / "roofline.md"
    markdown_path.write_text(roofline_table(report) + "\n")
    written = [json_path, markdown_path]
    try:
        written.append(plot_roofline(report, directory / "roofline.png"))
    except ImportError:
        print("roofline.png not drawn: matplotlib is not installed (pip install matplotlib)")
    return written


def plot_roofline(report: RooflineReport, path: Path) -> Path:
    """Log-log roofline: the ceilings as lines, each layer's achieved GFLOP/s per engine at its
    arithmetic intensity, numbered as in the table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ceilings = report.ceilings
    intensities = [layer.intensity for layer in report.layers]
    low, high = min(intensities, default=1) / 2, max(intensities, default=100) * 2
    ridge = ceilings.peak_gflops / ceilings.bandwidth_gbs
    axis_x = np.geomspace(min(low, ridge / 4), max(high, ridge * 4), 200)
    figure, axes = plt.subplots(figsize=(9, 6))
    axes.plot(axis_x, [ceilings.bound_gflops(x) for x in axis_x], color="black",
              label=f"roof: {ceilings.peak_gflops:g} GFLOP/s peak, {ceilings.bandwidth_gbs:g} GB/s")
    markers = {"tightfit": ("o", "tab:blue"), "onnxruntime": ("s", "tab:orange"),
               "tvm-default": ("^", "tab:gray")}
    for engine in ENGINES:
        marker, color = markers[engine]
        points = [(x, layer.gflops(engine), index) for index, (x, layer)
                  in enumerate(zip(intensities, report.layers), 1) if layer.gflops(engine)]
        axes.scatter([p[0] for p in points], [p[1] for p in points], marker=marker, color=color,
                     label=engine, zorder=3)
        if engine == "tightfit":
            for x, rate, index in points:
                axes.annotate(str(index), (x, rate), textcoords="offset points", xytext=(4, 4),
                              fontsize=8)
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("arithmetic intensity (FLOP per byte of inputs, weights and output)")
    axes.set_ylabel("GFLOP/s")
    axes.set_title("Largest conv and GEMM layers (numbers: rows of roofline.md)")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path

