"""ShareIdenticalKernels: kernels that fusion made more than once are kept once, and every call
goes to the copy that stays."""

import numpy as np
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import tightfit
from tightfit.feeds import run_onnxruntime
from tightfit.frontend import import_onnx
from tightfit.passes import ShareIdenticalKernels
from tightfit.passes.share_identical_kernels import SHARED_COPIES_ATTR
from tightfit.pipeline import PipelineOptions, run_pipeline
from tightfit.target import resolve_target


@I.ir_module
class ThreeScales:
    """`scale_a` and `scale_b` are one kernel under two names (and other buffer names); `halve`
    differs in its constant."""

    @T.prim_func(private=True)
    def scale_a(var_x: T.handle, var_y: T.handle):
        n = T.int64()
        x = T.match_buffer(var_x, (n,))
        y = T.match_buffer(var_y, (n,))
        for i in range(n):
            y[i] = x[i] * T.float32(2)

    @T.prim_func(private=True)
    def scale_b(var_u: T.handle, var_v: T.handle):
        m = T.int64()
        u = T.match_buffer(var_u, (m,))
        v = T.match_buffer(var_v, (m,))
        for j in range(m):
            v[j] = u[j] * T.float32(2)

    @T.prim_func(private=True)
    def halve(var_x: T.handle, var_y: T.handle):
        n = T.int64()
        x = T.match_buffer(var_x, (n,))
        y = T.match_buffer(var_y, (n,))
        for i in range(n):
            y[i] = x[i] * T.float32(0.5)

    @R.function
    def main(x: R.Tensor(("n",), "float32")) -> R.Tensor(("n",), "float32"):
        n = T.int64()
        cls = ThreeScales
        with R.dataflow():
            a = R.call_tir(cls.scale_a, (x,), out_ty=R.Tensor((n,), "float32"))
            b = R.call_tir(cls.scale_b, (a,), out_ty=R.Tensor((n,), "float32"))
            c = R.call_tir(cls.halve, (b,), out_ty=R.Tensor((n,), "float32"))
            R.output(c)
        return c


@I.ir_module
class TwoScales:
    @T.prim_func(private=True)
    def scale_a(var_x: T.handle, var_y: T.handle):
        n = T.int64()
        x = T.match_buffer(var_x, (n,))
        y = T.match_buffer(var_y, (n,))
        for i in range(n):
            y[i] = x[i] * T.float32(2)

    @T.prim_func(private=True)
    def halve(var_x: T.handle, var_y: T.handle):
        n = T.int64()
        x = T.match_buffer(var_x, (n,))
        y = T.match_buffer(var_y, (n,))
        for i in range(n):
            y[i] = x[i] * T.float32(0.5)

    @R.function
    def main(x: R.Tensor(("n",), "float32")) -> R.Tensor(("n",), "float32"):
        n = T.int64()
        cls = TwoScales
        with R.dataflow():
            a = R.call_tir(cls.scale_a, (x,), out_ty=R.Tensor((n,), "float32"))
            b = R.call_tir(cls.scale_a, (a,), out_ty=R.Tensor((n,), "float32"))
            c = R.call_tir(cls.halve, (b,), out_ty=R.Tensor((n,), "float32"))
            R.output(c)
        return c


def test_a_kernel_written_twice_is_kept_once_and_called_twice():
    shared = ShareIdenticalKernels()(ThreeScales)
    tvm.ir.assert_structural_equal(shared.without_attr(SHARED_COPIES_ATTR), TwoScales)
    assert int(shared.get_attr(SHARED_COPIES_ATTR)) == 1


def test_a_module_of_distinct_kernels_is_unchanged():
    assert ShareIdenticalKernels()(TwoScales).same_as(TwoScales)


@I.ir_module
class ScalarsInTwoOrders:
    """`scale_wh` is `scale_hw` with its two dims passed the other way round, as FuseTIR may
    order them in one compile and not in the next."""

    @T.prim_func(private=True)
    def scale_hw(var_x: T.handle, h: T.int64, w: T.int64, var_y: T.handle):
        x = T.match_buffer(var_x, (h, w))
        y = T.match_buffer(var_y, (h, w))
        for i, j in T.grid(h, w):
            y[i, j] = x[i, j] * T.float32(2)

    @T.prim_func(private=True)
    def scale_wh(var_x: T.handle, w: T.int64, h: T.int64, var_y: T.handle):
        x = T.match_buffer(var_x, (h, w))
        y = T.match_buffer(var_y, (h, w))
        for i, j in T.grid(h, w):
            y[i, j] = x[i, j] * T.float32(2)

    @R.function
    def main(x: R.Tensor(("h", "w"), "float32")) -> R.Tensor(("h", "w"), "float32"):
        h = T.int64()
        w = T.int64()
        cls = ScalarsInTwoOrders
        with R.dataflow():
            a = R.call_tir(cls.scale_hw, (x, R.prim_value(h), R.prim_value(w)), out_ty=R.Tensor((h, w), "float32"))
            b = R.call_tir(cls.scale_wh, (a, R.prim_value(w), R.prim_value(h)), out_ty=R.Tensor((h, w), "float32"))
            R.output(b)
        return b


@I.ir_module
class ScalarsInOneOrder:
    @T.prim_func(private=True)
    def scale_hw(var_x: T.handle, h: T.int64, w: T.int64, var_y: T.handle):
        x = T.match_buffer(var_x, (h, w))
        y = T.match_buffer(var_y, (h, w))
        for i, j in T.grid(h, w):
            y[i, j] = x[i, j] * T.float32(2)

    @R.function
    def main(x: R.Tensor(("h", "w"), "float32")) -> R.Tensor(("h", "w"), "float32"):
        h = T.int64()
        w = T.int64()
        cls = ScalarsInOneOrder
        with R.dataflow():
            a = R.call_tir(cls.scale_hw, (x, R.prim_value(h), R.prim_value(w)), out_ty=R.Tensor((h, w), "float32"))
            b = R.call_tir(cls.scale_hw, (a, R.prim_value(h), R.prim_value(w)), out_ty=R.Tensor((h, w), "float32"))
            R.output(b)
        return b


def test_kernels_equal_but_for_the_order_of_their_dims_are_one_and_each_call_passes_the_dims_in_its_order():
    shared = ShareIdenticalKernels()(ScalarsInTwoOrders)
    tvm.ir.assert_structural_equal(shared.without_attr(SHARED_COPIES_ATTR), ScalarsInOneOrder)


def _repeated_blocks() -> tuple:
    """Three conv + bias + ReLU blocks of the same width, each with weights of its own: fusion
    makes one kernel per block."""
    rng = np.random.default_rng(0)
    nodes, weights, x = [], [], "x"
    for block in range(3):
        weight = numpy_helper.from_array(rng.standard_normal((8, 8, 3, 3)).astype(np.float32) * 0.2, f"w{block}")
        bias = numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), f"b{block}")
        weights += [weight, bias]
        nodes += [helper.make_node("Conv", [x, f"w{block}", f"b{block}"], [f"c{block}"], pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{block}"], [f"r{block}"])]
        x = f"r{block}"
    graph = helper.make_graph(
        nodes, "repeated_blocks", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8, 12, 12])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["n", 8, 12, 12])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_repeated_blocks_compile_one_kernel_and_match_onnxruntime():
    model = _repeated_blocks()
    imported = import_onnx(model, None)
    lowered, _ = run_pipeline(imported.mod, resolve_target("host"), PipelineOptions(),
                              stop_after="tightfit.ShareIdenticalKernels")
    conv_kernels = [gv.name_hint for gv, func in lowered.functions.items()
                    if isinstance(func, tvm.tirx.PrimFunc) and "conv2d" in gv.name_hint]
    assert len(conv_kernels) == 1, conv_kernels

    package = tightfit.compile(model)
    assert package.report["shared_kernel_copies"] == 2
    session = package.session()
    for batch in (1, 3):
        feeds = {"x": np.random.default_rng(batch).standard_normal((batch, 8, 12, 12)).astype(np.float32)}
        expected = run_onnxruntime(model, feeds)["r2"]
        np.testing.assert_allclose(session.run(feeds)["r2"], expected, rtol=1e-4, atol=1e-4)
