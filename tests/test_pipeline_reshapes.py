"""A reshape between kernels is a view of its input's memory, not a copy kernel."""

import numpy as np

import tightfit
from tightfit.feeds import run_onnxruntime
from tightfit.frontend import import_onnx
from tightfit.pipeline import run_pipeline
from tightfit.target import resolve_target
from tightfit.testing import zoo
from tightfit.vm_code import interpreted


def test_flatten_before_the_classifier_is_a_view_and_leaves_no_kernel():
    """mobilenet_v2_style flattens its pooled features (batch, 16, 1, 1) -> (batch, 16) before
    the Gemm: the VM's reshape builtin, and no reshape PrimFunc left to compile. Scheduled
    first, the reshape's loops no longer matched TVM's pattern and it ran as a copy kernel.
    (The bytecode copy shows the view; native code passes it to the Gemm inside the kernel
    sequence, a descriptor of the same memory.)"""
    model = zoo.get("mobilenet_v2_style").build()
    lowered, _ = run_pipeline(import_onnx(model).mod, resolve_target("host"))
    assert 'R.call_packed("vm.builtin.reshape"' in lowered[interpreted("main")].script()
    assert [gv.name_hint for gv in lowered.functions if "reshape" in gv.name_hint] == []
    feeds = {"image": np.random.default_rng(0).random((2, 3, 40, 24), dtype=np.float32)}
    ours = tightfit.compile(model).session().run(feeds)
    expected = run_onnxruntime(model, feeds)
    np.testing.assert_allclose(ours["logits"], expected["logits"], rtol=1e-4, atol=1e-5)


def test_a_channel_shuffle_over_a_dynamic_map_reshapes_by_views():
    """grouped_convnet's channel shuffles (Reshape to (n, 3, 10, H x W), Transpose, Reshape to
    the input's shape) over a dynamic H x W: TVM cannot prove their reshape kernels reshapes
    (the indices divide by the symbolic extents), and they ran as copies, 257 us each at
    30 x 24 x 24. Marked when legalized, both are views; the transposes are the only kernels."""
    model = zoo.get("grouped_convnet").build()
    stages = {}
    session = tightfit.compile(model, after_pass=stages.setdefault).session()
    # the kernels as scheduling gets them: the reshapes are views or kernels by then
    kernels = [gv.name_hint for gv in stages["tightfit.ShareIdenticalKernels"].functions
               if gv.name_hint != "main"]
    assert [name for name in kernels if "reshape" in name] == []
    assert any("transpose" in name for name in kernels)
    for shape in [(1, 3, 96, 96), (2, 3, 50, 70)]:
        feeds = {"image": np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
        np.testing.assert_allclose(session.run(feeds)["logits"],
                                   run_onnxruntime(model, feeds)["logits"], rtol=1e-4, atol=1e-5)
