"""A reshape between kernels is a view of its input's memory, not a copy kernel."""

import numpy as np

import tightfit
from tightfit.feeds import run_onnxruntime
from tightfit.frontend import import_onnx
from tightfit.pipeline import run_pipeline
from tightfit.target import resolve_target
from tightfit.testing import zoo


def test_flatten_before_the_classifier_is_a_view_and_leaves_no_kernel():
    """mobilenet_v2_style flattens its pooled features (batch, 16, 1, 1) -> (batch, 16) before
    the Gemm: the VM's reshape builtin, and no reshape PrimFunc left to compile. Scheduled
    first, the reshape's loops no longer matched TVM's pattern and it ran as a copy kernel."""
    model = zoo.get("mobilenet_v2_style").build()
    lowered, _ = run_pipeline(import_onnx(model).mod, resolve_target("host"))
    assert 'R.call_packed("vm.builtin.reshape"' in lowered["main"].script()
    assert [gv.name_hint for gv in lowered.functions if "reshape" in gv.name_hint] == []
    feeds = {"image": np.random.default_rng(0).random((2, 3, 40, 24), dtype=np.float32)}
    ours = tightfit.compile(model).session().run(feeds)
    expected = run_onnxruntime(model, feeds)
    np.testing.assert_allclose(ours["logits"], expected["logits"], rtol=1e-4, atol=1e-5)
