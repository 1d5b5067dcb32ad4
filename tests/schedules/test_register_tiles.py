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

from tightfit.frontend import import_onnx
from tightfit.kernel_lowering import KERNEL_LOWERING
from tightfit.pipeline import BUILD_CONFIG, run_pipeline
from tightfit.schedules.register_tile import ROW_TILES_OUTER_MAX_WEIGHT_BYTES
from tightfit.target import resolve_target
from tightfit.testing import zoo

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


def lowered_for_code_generation(func: tirx.PrimFunc) -> str:
    """`func` as TVM hands it to LLVM: tightfit's TIR pipeline, under the build's config, then
    the host finalization (LowerTVMBuiltin, which makes buffers stack arrays or heap
    workspaces)."""
    target = resolve_target("host").tvm_target
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    mod = tirx.transform.BindTarget(target.with_host(target))(mod)
    lower, finalize_host, _ = compilation_pipeline.get_tir_pipeline(KERNEL_LOWERING)
    with tvm.transform.PassContext(opt_level=3, config=BUILD_CONFIG):
        host, _ = split_host_device_mods(lower(mod))
        return finalize_host()(host).script()


def conv1d_over_a_symbolic_length() -> onnx.ModelProto:
    """speech_encoder's first layer: its kernel has serial versions for short and long maps."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3], strides=[2], pads=[1, 1])],
        "conv1d", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 40, "length"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32, None])],
        [numpy_helper.from_array(rng.standard_normal((32, 40, 3)).astype(np.float32), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.xfail(strict=True, reason="known: TVM's StorageRewrite merges the buffers of a "
                   "kernel's serial versions into one allocation; with a static batch a version's "
                   "packed input is a constant 1 KB or more, and the accumulator tiles merged "
                   "into it become a heap workspace")
@pytest.mark.parametrize("model", ["conv1d", "conv_dynamic_hw"])
def test_accumulator_tiles_stay_stack_arrays_in_every_version(model):
    """No version's tile shares an allocation with another version's buffers. StorageRewrite
    merges buffers whose lives do not overlap within one scope, and the serial versions, each
    in a branch of the function's body, share it: the tiles then live in a heap workspace and
    LLVM stores every accumulator after every multiply-add (isa.py). A conv1d over a symbolic
    length (40 -> 32 channels, stride 2, 2 x 77, one thread) ran 23.7 us against 7.3 us over a
    static length. Turning the reuse off ("tirx.merge_static_smem") gave 8.1 us, but every
    version's buffers then take an allocation of their own on every call, which cost 2-6% on
    the zoo's small models; the fix has to keep the tiles out of the merge alone."""
    onnx_model = conv1d_over_a_symbolic_length() if model == "conv1d" else zoo.get(model).build()
    scheduled, _ = run_pipeline(import_onnx(onnx_model).mod, resolve_target("host"),
                                stop_after="tightfit.FallbackCPUSchedule")
    kernels = [func for func in scheduled.functions.values()
               if isinstance(func, tirx.PrimFunc) and "tightfit.kernel" in func.script()]
    assert kernels
    for func in kernels:
        declarations = re.findall(r"(\w+_tiles\w*) = (T\.\w+|\w+\.view)\(", lowered_for_code_generation(func))
        assert declarations
        not_on_stack = [(name, how) for name, how in declarations if how != "T.alloc_buffer"]
        assert not not_on_stack, f"tiles in heap workspaces: {not_on_stack}"
