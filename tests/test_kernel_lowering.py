"""Kernels take tensors at any element-aligned address, and a session hands them its inputs
where they lie (kernel_lowering.py)."""

import re

import numpy as np
import pytest
import tvm
from tvm import tirx
from tvm.tirx import compilation_pipeline

import tightfit
from tightfit.feeds import random_feeds, run_onnxruntime
from tightfit.frontend import declared_inputs, import_onnx
from tightfit.kernel_lowering import KERNEL_LOWERING, element_bytes
from tightfit.pipeline import run_pipeline
from tightfit.target import resolve_target
from tightfit.testing import zoo

ALIGNMENT_ATTRIBUTE = re.compile(r'T\.attr\((\w+), "storage_alignment", (\d+)\)')


def _lowered_kernels(model) -> tuple[tvm.IRModule, tvm.IRModule]:
    """The model's kernels as the build gets them, and as KERNEL_LOWERING leaves them."""
    target = resolve_target("host")
    lowered, _ = run_pipeline(import_onnx(model).mod, target)
    kernels = tvm.IRModule({gv: func for gv, func in lowered.functions.items()
                            if isinstance(func, tirx.PrimFunc)})
    kernels = tirx.transform.BindTarget(target.tvm_target.with_host(target.tvm_target))(kernels)
    lower, _, _ = compilation_pipeline.get_tir_pipeline(KERNEL_LOWERING)
    return kernels, lower(kernels)


def test_each_tensor_argument_is_assumed_aligned_to_its_element_only():
    """nonzero_gather's kernels take bool, int64 and float32 tensors, and include a kernel
    sequence and a shape-heap writer; TVM's wrapper assumes 64 bytes for every one."""
    kernels, lowered = _lowered_kernels(zoo.get("nonzero_gather").build())
    sizes_seen = set()
    for global_var, kernel in kernels.functions.items():
        tensors = {param.name: element_bytes(param) for param in kernel.params
                   if isinstance(param.ty, tirx.BufferType)}
        assumed = {name: int(value)
                   for name, value in ALIGNMENT_ATTRIBUTE.findall(lowered[global_var.name_hint].script())}
        assert assumed == tensors, global_var.name_hint
        sizes_seen.update(tensors.values())
    assert sizes_seen == {1, 4, 8}


def _at_offset(array: np.ndarray, offset: int) -> np.ndarray:
    """A copy of `array` whose data starts `offset` bytes past a 64-byte boundary."""
    raw = np.empty(array.nbytes + 128, np.uint8)
    start = -raw.ctypes.data % 64 + offset
    placed = raw[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    placed[...] = array
    return placed


@pytest.mark.parametrize("name", ["gated_skip_block", "nonzero_gather"])
def test_inputs_at_every_element_aligned_address_run_in_place_and_match_onnxruntime(name):
    """Vectorized conv, matmul and gather kernels read the inputs where numpy put them: a
    kernel still assuming 64-byte alignment crashes on the first misaligned one (LLVM's
    aligned vector loads)."""
    entry = zoo.get(name)
    model = entry.build()
    session = tightfit.compile(model).session()
    shapes = entry.shape_sets[0]
    feeds = (entry.feeds or (lambda s: random_feeds(declared_inputs(model.graph), s)))(shapes)
    expected = run_onnxruntime(model, feeds)
    for offset in range(0, 64, 4):
        placed = {input_name: _at_offset(array, offset) for input_name, array in feeds.items()}
        outputs = session.run(placed)
        for output_name, value in expected.items():
            np.testing.assert_allclose(outputs[output_name], value, rtol=1e-5, atol=1e-5)
        tensors = session.prepare_inputs(placed)
        assert [np.from_dlpack(tensor).ctypes.data for tensor in tensors] == \
            [placed[input_name].ctypes.data for input_name in session.input_names]
