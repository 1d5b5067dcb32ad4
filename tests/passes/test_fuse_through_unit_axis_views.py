"""FuseThroughUnitAxisViews: a kernel's epilogue fuses through the squeeze and expand_dims of a
conv1d computed as a one-row conv2d."""

import numpy as np
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.script import relax as R

import tightfit
from tightfit.feeds import run_onnxruntime
from tightfit.frontend import import_onnx
from tightfit.passes import FuseThroughUnitAxisViews, legalize_views
from tightfit.pipeline import PipelineOptions, run_pipeline
from tightfit.target import resolve_target


def _conv1d_stack() -> tvm.IRModule:
    """Two conv1d layers as SelectConvAlgorithm writes them: a conv2d over a one-row image
    between expand_dims and squeeze, the bias and ReLU on the squeezed tensor."""

    @tvm.script.ir_module
    class Stack:
        @R.function
        def main(x: R.Tensor(("n", 4, 1, "w"), "float32"), weight: R.Tensor((4, 4, 1, 3), "float32"),
                 bias: R.Tensor((1, 4, 1), "float32")):
            with R.dataflow():
                first = R.nn.conv2d(x, weight, padding=[0, 1, 0, 1])
                squeezed = R.squeeze(first, [2])
                biased = R.add(squeezed, bias)
                activated = R.nn.relu(biased)
                row = R.expand_dims(activated, [2])
                second = R.nn.conv2d(row, weight, padding=[0, 1, 0, 1])
                out = R.squeeze(second, [2])
                R.output(out)
            return out

    return Stack


def _fused(passes) -> tvm.IRModule:
    mod = _conv1d_stack()
    for compiler_pass in [relax.transform.LegalizeOps(legalize_views()),
                          relax.transform.AnnotateTIROpPattern(), *passes,
                          relax.transform.FuseOps(), relax.transform.FuseTIR()]:
        mod = compiler_pass(mod)
    return mod


def _called_kernels(mod: tvm.IRModule) -> list[str]:
    return [str(gv.name_hint) for gv in mod.functions if isinstance(mod[gv], tvm.tirx.PrimFunc)]


def test_the_epilogue_and_the_views_around_it_join_the_conv_before_them():
    kernels = _called_kernels(_fused([FuseThroughUnitAxisViews()]))
    assert len(kernels) == 2, kernels  # one per conv
    assert any(name.startswith("fused_conv2d") and name.endswith("squeeze_add_relu_expand_dims")
               for name in kernels), kernels
    # without the pass TVM calls the squeeze broadcast, and the conv keeps no epilogue
    assert "fused_squeeze_add_relu_expand_dims" in _called_kernels(_fused([]))


def _conv1d_model():
    rng = np.random.default_rng(7)
    nodes, initializers, previous = [], [], "x"
    for layer, (channels, out_channels, stride) in enumerate([(5, 8, 2), (8, 8, 2)]):
        weight = rng.standard_normal((out_channels, channels, 3)).astype(np.float32)
        bias = rng.standard_normal(out_channels).astype(np.float32)
        initializers += [numpy_helper.from_array(weight, f"w{layer}"),
                         numpy_helper.from_array(bias, f"b{layer}")]
        nodes += [helper.make_node("Conv", [previous, f"w{layer}", f"b{layer}"], [f"c{layer}"],
                                   kernel_shape=[3], strides=[stride], pads=[1, 1]),
                  helper.make_node("Relu", [f"c{layer}"], [f"r{layer}"])]
        previous = f"r{layer}"
    graph = helper.make_graph(
        nodes, "conv1d_stack",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 5, "length"])],
        [helper.make_tensor_value_info(previous, TensorProto.FLOAT, ["n", 8, "out"])], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_conv1d_stack_with_its_epilogues_fused_matches_onnxruntime():
    model = _conv1d_model()
    scheduled, _ = run_pipeline(import_onnx(model).mod, resolve_target("host"), PipelineOptions(),
                                stop_after="tightfit.FallbackCPUSchedule")
    relus = [gv.name_hint for gv in scheduled.functions if "relu" in gv.name_hint]
    assert len(relus) == 2 and all(name.startswith("fused_conv2d") for name in relus), relus
    session = tightfit.compile(model).session()
    for length in [1, 2, 17, 64]:
        x = np.random.default_rng(length).standard_normal((2, 5, length)).astype(np.float32)
        np.testing.assert_allclose(session.run({"x": x})["r1"],
                                   run_onnxruntime(model, {"x": x})["r1"], rtol=1e-5, atol=1e-5,
                                   err_msg=f"length {length}")
