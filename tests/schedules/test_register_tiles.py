"""Every kernel's accumulator tile compacts to one register tile at a constant offset.

TVM keeps a small buffer as a stack array that LLVM promotes to registers only when every
access is at a constant offset (isa.py). When a tile's offset depends on the parallel loop
through a division by a symbolic extent (`fused // (height // 2)`), TVM's analyzer cannot
prove it constant, the compacted tile keeps that offset, and the accumulators live in memory:
the width-vectors conv ran 3x slower inside conv_dynamic_hw that way. The models here have
symbolic batch, height, width and sequence.
"""

import re

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import s_tir, tirx
from tvm.tirx import compilation_pipeline
from tvm.tirx.build import split_host_device_mods

import tightfit
from tightfit.feeds import run_onnxruntime
from tightfit.frontend import import_onnx
from tightfit.kernel_lowering import KERNEL_LOWERING
from tightfit.pipeline import BUILD_CONFIG, run_pipeline
from tightfit.schedules.register_tile import ROW_TILES_OUTER_MAX_WEIGHT_BYTES
from tightfit.target import resolve_target
from tightfit.testing import zoo

from kernel_harness import AVX512_TARGET

LOWER_TO_FLAT_BUFFERS = tvm.transform.Sequential([
    s_tir.transform.LowerInitBlock(), s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
    s_tir.transform.ConvertBlocksToOpaque(), s_tir.transform.CompactBufferAllocation(),
    s_tir.transform.LowerMatchBuffer(), s_tir.transform.LowerOpaqueBlock(),
    tirx.transform.FlattenBuffer(),
    s_tir.transform.StmtSimplify()])
# an index that still divides, takes a remainder or clamps is not a constant offset
NOT_CONSTANT_OFFSET = re.compile(r"//|%|T\.max|T\.min")


def tile_indices(func: tirx.PrimFunc) -> dict[str, set[str]]:
    """The flattened indices of every access to a kernel's tile buffers, by buffer name."""
    text = LOWER_TO_FLAT_BUFFERS(tvm.IRModule({"main": func})).script()
    indices: dict[str, set[str]] = {}
    for name, index in re.findall(r"(\w+_tiles\w*)\[([^\]]*)\]", text):
        indices.setdefault(name, set()).add(index)
    return indices


def wide_head() -> onnx.ModelProto:
    """MobileNetV2's last layers at a fraction of its compile time: pointwise convs 32 -> 320 ->
    256 (a 320 KB weight) and a 256 -> 1000 classifier (1 MB), past
    ROW_TILES_OUTER_MAX_WEIGHT_BYTES, so their tiles run column panels outermost."""
    rng = np.random.default_rng(0)
    weights = {"w1": (320, 32, 1, 1), "w2": (256, 320, 1, 1), "fc": (1000, 256)}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"]), helper.make_node("Relu", ["a"], ["r"]),
             helper.make_node("Conv", ["r", "w2"], ["b"]), helper.make_node("GlobalAveragePool", ["b"], ["p"]),
             helper.make_node("Flatten", ["p"], ["f"]), helper.make_node("Gemm", ["f", "fc"], ["y"], transB=1)]
    graph = helper.make_graph(
        nodes, "wide_head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 32, "height", "width"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1000])],
        [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) * 0.1, name)
         for name, shape in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


MODELS = {name: lambda name=name: zoo.get(name).build()
          for name in ["conv_dynamic_hw", "mobilenet_v2_style", "resnet_style", "transformer_encoder"]}
MODELS["wide_head"] = wide_head


@pytest.mark.parametrize("model", sorted(MODELS))
def test_accumulator_tiles_sit_at_constant_offsets(model):
    scheduled, _ = run_pipeline(import_onnx(MODELS[model]()).mod, resolve_target("host"),
                                stop_after="tightfit.FallbackCPUSchedule")
    kernels = {global_var.name_hint: func for global_var, func in scheduled.functions.items()
               if isinstance(func, tirx.PrimFunc) and "tightfit.kernel" in func.script()}
    assert kernels, f"{model} has no tightfit kernels"
    for name, func in kernels.items():
        for tile, indices in tile_indices(func).items():
            moving = sorted(index for index in indices if NOT_CONSTANT_OFFSET.search(index))
            assert not moving, f"{name}: {tile} is indexed at a run-time offset: {moving[0]}"


def test_wide_head_kernels_run_column_panels_outermost():
    """The case above that covers the panels-outermost loop order does reach it."""
    scheduled, _ = run_pipeline(import_onnx(wide_head()).mod, resolve_target("host"),
                                stop_after="tightfit.FallbackCPUSchedule")
    wide = [func.script() for func in scheduled.functions.values() if isinstance(func, tirx.PrimFunc)
            and any(int(size) > ROW_TILES_OUTER_MAX_WEIGHT_BYTES
                    for size in re.findall(r'"tightfit.weight_bytes": (\d+)', func.script()))]
    assert len(wide) == 2  # the 320 -> 256 conv and the classifier
    for text in wide:
        # a parallel loop over the panels alone (the classifier), or over images then panels
        assert re.search(r"in T\.parallel\((T\.int64\(\d+\)|batch \* T\.int64\(\d+\))\)", text)


def lowered_for_code_generation(func: tirx.PrimFunc, target) -> str:
    """`func` as TVM hands it to LLVM for `target`: tightfit's TIR pipeline, under the build's
    config, then the host finalization (LowerTVMBuiltin, which makes buffers stack arrays or
    heap workspaces)."""
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    mod = tirx.transform.BindTarget(target.with_host(target))(mod)
    lower, finalize_host, _ = compilation_pipeline.get_tir_pipeline(KERNEL_LOWERING)
    with tvm.transform.PassContext(opt_level=3, config=BUILD_CONFIG):
        host, _ = split_host_device_mods(lower(mod))
        return finalize_host()(host).script()


def tile_storage(lowered: str) -> dict[str, str]:
    """How each tile buffer of a lowered kernel is stored: "stack" (an array of its own, or a
    view of one) or "heap" (TVMBackendAllocWorkspace, or a view of such a buffer)."""
    storage: dict[str, str] = {}
    for name, declaration in re.findall(r"(\w+) = (T\.alloc_\w+\(|T\.decl_buffer\(.*|\w+\.view\()",
                                        lowered):
        viewed = re.match(r"(\w+)\.view\(", declaration) or re.search(r"data=(\w+)\.data", declaration)
        if declaration.startswith("T.alloc_"):
            storage[name] = "stack"
        elif "TVMBackendAllocWorkspace" in declaration:
            storage[name] = "heap"
        elif viewed and viewed.group(1) in storage:
            storage[name] = storage[viewed.group(1)]
    return {name: kind for name, kind in storage.items() if "_tiles" in name}


def conv1d_over_a_symbolic_length() -> onnx.ModelProto:
    """speech_encoder's first layer: its kernel has serial versions for short and long maps."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3], strides=[2], pads=[1, 1])],
        "conv1d", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 40, "length"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32, None])],
        [numpy_helper.from_array(rng.standard_normal((32, 40, 3)).astype(np.float32), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("target", ["host", AVX512_TARGET], ids=["host", "avx512"])
@pytest.mark.parametrize("model", ["conv1d", "conv_dynamic_hw"])
def test_accumulator_tiles_stay_stack_arrays_in_every_version(model, target):
    """No version's tile lives in a heap workspace. TVM's StorageRewrite merges buffers whose
    lives do not overlap within one scope, and the serial versions, each in a branch of the
    function's body, share it: a tile merged with another version's packed input of 1 KB or
    more lived in a heap workspace, and LLVM stored every accumulator after every multiply-add
    (isa.py; the conv1d's 11 x 16 tiles on AVX-512: 23.7 us against 7.3 us over a static
    length). Tiles are in TILE_SCOPE, which StorageRewrite does not merge."""
    onnx_model = conv1d_over_a_symbolic_length() if model == "conv1d" else zoo.get(model).build()
    compile_target = resolve_target(target)
    with compile_target.tvm_target:
        scheduled, _ = run_pipeline(import_onnx(onnx_model).mod, compile_target,
                                    stop_after="tightfit.FallbackCPUSchedule")
    kernels = [func for func in scheduled.functions.values()
               if isinstance(func, tirx.PrimFunc) and "tightfit.kernel" in func.script()]
    assert kernels
    for func in kernels:
        lowered = lowered_for_code_generation(func, compile_target.tvm_target)
        storage = tile_storage(lowered)
        assert storage, "no tile buffer found"
        heap = sorted(name for name, kind in storage.items() if kind == "heap")
        assert not heap, f"tiles in heap workspaces: {heap}"
        if model == "conv1d":  # the case the merge hit: a heap packed input beside the tiles
            assert "TVMBackendAllocWorkspace" in lowered
    if model == "conv1d" and target == "host":
        session = tightfit.compile(onnx_model).session()
        rng = np.random.default_rng(1)
        for length in (12, 40, 77):  # serial versions over short and long maps
            feeds = {"x": rng.standard_normal((2, 40, length)).astype(np.float32)}
            np.testing.assert_allclose(session.run(feeds)["y"], run_onnxruntime(onnx_model, feeds)["y"],
                                       rtol=1e-4, atol=1e-4)
