"""softmax(Q K^T x scale) V as one kernel (passes/fuse_attention.py, schedules/attention.py)
matches onnxruntime in every version: serial and parallel (the knob databases), whole and partial
query tiles, every query and key count up to two tiles and one more, keys as K or K^T, scaled
or not, masked or not, the head merge done by its stores or not, V's columns in one chunk or
several, the heads read from a QKV projection."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
import tvm
from tvm import relax

import tightfit
from tightfit.feeds import run_onnxruntime
from tightfit.passes import fuse_attention
from tightfit.pipeline import PipelineOptions
from tightfit.schedules.attention import value_chunks
from tightfit.schedules.isa import isa_for_target
from tightfit.target import resolve_target

from kernel_harness import SCHEDULED, compile_keeping, input_shapes

FUSED = "tightfit.FuseAttention"

LANES = isa_for_target(resolve_target("host").tvm_target).lanes


def attention_model(batch=(2, 3), depth=8, values=8, keys_as_rows=True, scale="Div",
                    perm=None, output_probabilities=False, mask=None) -> onnx.ModelProto:
    """softmax(q k^T (scale) c (+ mask)) v over [*batch, queries, depth] queries and
    [*batch, keys, ...] keys and values: k given as K (transposed in the graph) or as K^T; c a
    constant, or a run-time input for scale "DivInput"; `mask` the shape of an added mask
    input, broadcast to the scores (None: no mask); the result transposed by `perm`;
    `output_probabilities`: the softmax is an output of its own too (nothing fuses)."""
    b = list(batch)
    axes = list(range(len(b)))
    nodes, inputs, initializers = [], [], []
    inputs.append(helper.make_tensor_value_info("q", TensorProto.FLOAT, b + ["queries", depth]))
    if keys_as_rows:
        inputs.append(helper.make_tensor_value_info("k", TensorProto.FLOAT, b + ["keys", depth]))
        nodes.append(helper.make_node("Transpose", ["k"], ["kt"], perm=axes + [len(b) + 1, len(b)]))
    else:
        inputs.append(helper.make_tensor_value_info("kt", TensorProto.FLOAT, b + [depth, "keys"]))
    inputs.append(helper.make_tensor_value_info("v", TensorProto.FLOAT, b + ["keys", values]))
    nodes.append(helper.make_node("MatMul", ["q", "kt"], ["scores"]))
    scores = "scores"
    if scale is not None:
        if scale == "DivInput":
            inputs.append(helper.make_tensor_value_info("c", TensorProto.FLOAT, []))
        else:
            initializers.append(numpy_helper.from_array(np.array(0.35, np.float32), "c"))
        op = "Mul" if scale == "Mul" else "Div"
        nodes.append(helper.make_node(op, ["scores", "c"], ["scaled"]))
        scores = "scaled"
    if mask is not None:
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.FLOAT, mask))
        nodes.append(helper.make_node("Add", [scores, "mask"], ["masked"]))
        scores = "masked"
    nodes.append(helper.make_node("Softmax", [scores], ["p"], axis=-1))
    nodes.append(helper.make_node("MatMul", ["p", "v"], ["o" if perm else "y"]))
    out_shape = b + ["queries", values]
    if perm:
        nodes.append(helper.make_node("Transpose", ["o"], ["y"], perm=perm))
        out_shape = [out_shape[axis] for axis in perm]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)]
    if output_probabilities:
        outputs.append(helper.make_tensor_value_info("p", TensorProto.FLOAT,
                                                     b + ["queries", "keys"]))
    graph = helper.make_graph(nodes, "attention", inputs, outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def feeds_for(model: onnx.ModelProto, queries: int, keys: int, seed: int = 0) -> dict:
    """Random inputs of `model` at `queries` queries and `keys` keys; a run-time scale of 0.4."""
    rng = np.random.default_rng(seed)
    feeds = {name: (rng.standard_normal(shape) * 1.5).astype(np.float32) for name, shape
             in input_shapes(model, {"queries": queries, "keys": keys}).items()}
    if "c" in feeds:
        feeds["c"] = np.array(0.4, np.float32)
    return feeds


def kernel_names(scheduled: tvm.IRModule) -> list[str]:
    return [global_var.name_hint for global_var, func in scheduled.functions.items()
            if not global_var.name_hint == "main"]


def matmul_columns(fused: tvm.IRModule) -> list[int]:
    """The column count of each matmul of a module after FuseAttention."""
    columns = []

    def visit(expr):
        if (isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op)
                and expr.op.name == "relax.matmul"):
            columns.append(int(expr.ty.shape.values[-1]))

    relax.analysis.post_order_visit(fused["main"], visit)
    return columns


def assert_matches(model, session, queries: int, keys: int) -> None:
    feeds = feeds_for(model, queries, keys, seed=queries * 100 + keys)
    expected = run_onnxruntime(model, feeds)
    ours = session.run(feeds)
    for name, value in expected.items():
        np.testing.assert_allclose(ours[name], value, rtol=1e-4, atol=1e-5,
                                   err_msg=f"{name} at {queries} queries, {keys} keys")


CASES = {
    "head-merge": dict(perm=[0, 2, 1, 3]),
    "keys-transposed-multiplied": dict(keys_as_rows=False, scale="Mul"),
    "run-time-scale-sequence-first": dict(scale="DivInput", perm=[2, 0, 1, 3]),
    "unscaled-one-batch-axis": dict(batch=(3,), scale=None),
    "wide-heads": dict(batch=(2,), depth=40, values=2 * value_chunks(10 ** 6, LANES)[0][1] + 3,
                       perm=[1, 0, 2]),
    "narrow-heads": dict(batch=(2, 2), depth=3, values=1),
    "padding-mask": dict(batch=(2, 3), mask=[2, 1, 1, "keys"], perm=[0, 2, 1, 3]),
    "query-key-mask": dict(batch=(3,), mask=["queries", "keys"], scale="Mul"),
    "full-mask-unscaled": dict(batch=(2,), mask=[2, "queries", "keys"], scale=None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_attention_kernel_matches_onnxruntime_at_tile_edges(knob_database, monkeypatch, case):
    """Every sequence from 1 to two query tiles and one more, queries and keys equal, and a
    partial tile against many keys and a whole one against few: no softmax or matmul kernel
    is left (the one attention kernel does it all), and the outputs match onnxruntime. Wide
    heads, which FuseAttention leaves to the GEMM kernels, are fused with its limit raised:
    the kernel's query rows out of registers, V's columns in several chunks. An added mask is
    read broadcast: one row for every query (padding), a row per query, or a mask per batch
    entry."""
    monkeypatch.setattr(fuse_attention, "MAX_HEAD_WIDTH", 1000)
    model = attention_model(**CASES[case])
    package, scheduled = compile_keeping(model, SCHEDULED, options=PipelineOptions(knob_database=knob_database))
    names = kernel_names(scheduled)
    assert any(name.startswith("attention") for name in names), names
    assert not any("softmax" in name or "matmul" in name for name in names), names
    session = package.session()
    for sequence in range(1, 2 * LANES + 2):
        assert_matches(model, session, sequence, sequence)
    assert_matches(model, session, LANES - 1, 3 * LANES + 5)
    assert_matches(model, session, LANES, 2)


def qkv_attention_model(cut: str, heads: int = 4, depth: int = 8,
                        operands_scaled: bool = False, mask: str | None = None) -> onnx.ModelProto:
    """x [batch, sequence, width] through one QKV projection, its heads cut off as exporters
    do (a reshape to [batch, sequence, 3, heads, depth], a transpose putting the 3 first, then
    a Slice and a Squeeze, a Split and Squeezes, or a Gather at 0, 1 and 2), or through three
    projections with biases (cut "separate", as BERT's: each reshaped to [batch, sequence,
    heads, depth] and transposed), attention per head, the heads merged back. The scores are
    divided by sqrt(depth), or with `operands_scaled` Q and K^T are each multiplied by a [1]
    tensor of depth^-1/4, as nn.MultiheadAttention's export does. `mask`: a "padding" mask
    input [batch, 1, 1, sequence] or a "per-query" one [sequence, sequence] added to the
    scaled scores."""
    rng = np.random.default_rng(1)
    width = heads * depth
    initializers = [
        numpy_helper.from_array((rng.standard_normal((width, 3 * width)) * 0.3)
                                .astype(np.float32), "w"),
        numpy_helper.from_array(np.array([0, 0, 3, heads, depth], np.int64), "heads_shape"),
        numpy_helper.from_array(np.array([0, 0, width], np.int64), "merged_shape"),
        numpy_helper.from_array(np.array(depth ** 0.5, np.float32), "c"),
        numpy_helper.from_array(np.array([depth ** -0.25], np.float32), "root_c"),
        numpy_helper.from_array(np.array([0], np.int64), "axis0"),
        numpy_helper.from_array(np.array([0, 0, heads, depth], np.int64), "head_shape")]
    nodes = [] if cut == "separate" else [
        helper.make_node("MatMul", ["x", "w"], ["qkv"]),
        helper.make_node("Reshape", ["qkv", "heads_shape"], ["heads"]),
        helper.make_node("Transpose", ["heads"], ["qkv_first"], perm=[2, 0, 3, 1, 4])]
    if cut == "split":
        nodes.append(helper.make_node("Split", ["qkv_first"], ["q_split", "k_split", "v_split"],
                                      axis=0, num_outputs=3))
    for index, name in enumerate("qkv"):
        initializers.append(numpy_helper.from_array(np.array(index, np.int64), f"at{index}"))
        initializers.append(numpy_helper.from_array(np.array([index + 1], np.int64),
                                                    f"to{index}"))
        if cut == "slice":
            nodes += [helper.make_node("Unsqueeze", [f"at{index}", "axis0"], [f"from{index}"]),
                      helper.make_node("Slice", ["qkv_first", f"from{index}", f"to{index}",
                                                 "axis0"], [f"{name}_sliced"]),
                      helper.make_node("Squeeze", [f"{name}_sliced", "axis0"], [name])]
        elif cut == "gather":
            nodes.append(helper.make_node("Gather", ["qkv_first", f"at{index}"], [name], axis=0))
        elif cut == "separate":
            initializers.append(numpy_helper.from_array(
                numpy_helper.to_array(initializers[0])[:, index * width:(index + 1) * width],
                f"w{index}"))
            initializers.append(numpy_helper.from_array(
                rng.standard_normal(width).astype(np.float32), f"b{index}"))
            nodes += [helper.make_node("MatMul", ["x", f"w{index}"], [f"{name}_product"]),
                      helper.make_node("Add", [f"{name}_product", f"b{index}"],
                                       [f"{name}_projected"]),
                      helper.make_node("Reshape", [f"{name}_projected", "head_shape"],
                                       [f"{name}_heads"]),
                      helper.make_node("Transpose", [f"{name}_heads"], [name], perm=[0, 2, 1, 3])]
        else:
            nodes.append(helper.make_node("Squeeze", [f"{name}_split", "axis0"], [name]))
    nodes.append(helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]))
    if operands_scaled:
        nodes += [helper.make_node("Mul", ["q", "root_c"], ["q_scaled"]),
                  helper.make_node("Mul", ["kt", "root_c"], ["kt_scaled"]),
                  helper.make_node("MatMul", ["q_scaled", "kt_scaled"], ["scaled"])]
    else:
        nodes += [helper.make_node("MatMul", ["q", "kt"], ["scores"]),
                  helper.make_node("Div", ["scores", "c"], ["scaled"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", width])]
    if mask is not None:
        inputs.append(helper.make_tensor_value_info(
            "mask", TensorProto.FLOAT,
            ["batch", 1, 1, "sequence"] if mask == "padding" else ["sequence", "sequence"]))
        nodes.append(helper.make_node("Add", ["scaled", "mask"], ["masked"]))
    nodes += [helper.make_node("Softmax", ["masked" if mask else "scaled"], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", "v"], ["o"]),
              helper.make_node("Transpose", ["o"], ["merged"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["merged", "merged_shape"], ["y"])]
    graph = helper.make_graph(
        nodes, "qkv_attention", inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "sequence", width])],
        initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("cut", ["slice", "split", "gather", "gather-operands-scaled",
                                 "separate"])
def test_heads_cut_from_a_qkv_projection_are_read_from_it(knob_database, cut):
    """Q, K and V that a reshape, a transpose and a slice, split or gather cut from one QKV
    projection are read from the projection itself, at strides of 3 x width per query (three
    projections of the same input, weights and biases, are merged into that one), and a
    Q and a K^T each scaled by one number scale the scores: no copy or multiply kernel is left
    between the projection and the attention kernel, and every sequence up to two query tiles
    and one more matches onnxruntime, for one and three batch entries."""
    model = qkv_attention_model(cut.split("-")[0], operands_scaled=cut.endswith("scaled"))
    package, fused, scheduled = compile_keeping(model, FUSED, SCHEDULED,
                                                options=PipelineOptions(knob_database=knob_database))
    names = kernel_names(scheduled)
    assert any(name.startswith("attention") for name in names), names
    assert not any(op in name for name in names
                   for op in ("slice", "split", "take", "transpose", "squeeze", "multiply")), names
    # three projections of x are merged into one GEMM (merged_projections.py), and one
    # projection is kept as it is: 3 x width columns either way
    assert sum("dense" in name or "matmul" in name for name in names) == 1, names
    assert matmul_columns(fused) == [3 * 32]
    session = package.session()
    for batch in (1, 3):
        for sequence in range(1, 2 * LANES + 2):
            feeds = {"x": np.random.default_rng(sequence).standard_normal(
                (batch, sequence, 32)).astype(np.float32)}
            np.testing.assert_allclose(session.run(feeds)["y"],
                                       run_onnxruntime(model, feeds)["y"], rtol=1e-4,
                                       atol=1e-5, err_msg=f"{batch} x {sequence}")


def qkv_feeds(model: onnx.ModelProto, batch: int, sequence: int) -> dict[str, np.ndarray]:
    """x at [batch, sequence, width], and a mask input (if any) of 0 and -10000 entries."""
    rng = np.random.default_rng(batch * 100 + sequence)
    feeds = {}
    for name, shape in input_shapes(model, {"batch": batch, "sequence": sequence}).items():
        if name == "mask":
            # at least one key left to every query: the last
            masked = rng.random(shape) < 0.3
            masked[..., -1] = False
            feeds["mask"] = np.where(masked, -10000.0, 0.0).astype(np.float32)
        else:
            feeds[name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


@settings(max_examples=12, deadline=None)
@example(cut="slice", operands_scaled=False, mask=None, heads=1, depth=1)  # one statement
@given(cut=st.sampled_from(["slice", "split", "gather", "separate"]),
       operands_scaled=st.booleans(), mask=st.sampled_from([None, "padding", "per-query"]),
       heads=st.integers(1, 4), depth=st.integers(1, 8))
def test_any_qkv_attention_is_one_kernel_over_one_gemm_and_matches_onnxruntime(
        cut, operands_scaled, mask, heads, depth):
    """Every combination of how the heads are cut, how the scores are scaled, which mask is
    added, and the heads' count and width: one attention kernel reading one GEMM of 3 x width
    columns, matching onnxruntime for 1 and 2 batch entries across a query tile's edge."""
    model = qkv_attention_model(cut, heads, depth, operands_scaled, mask)
    package, fused, scheduled = compile_keeping(model, FUSED, SCHEDULED)
    names = kernel_names(scheduled)
    assert sum(name.startswith("attention") for name in names) == 1, names
    assert matmul_columns(fused) == [3 * heads * depth]
    session = package.session()
    for batch, sequence in ((1, 1), (2, LANES - 1), (1, LANES + 2)):
        feeds = qkv_feeds(model, batch, sequence)
        np.testing.assert_allclose(session.run(feeds)["y"], run_onnxruntime(model, feeds)["y"],
                                   rtol=1e-4, atol=1e-5, err_msg=f"{batch} x {sequence}")


@pytest.mark.parametrize("change", ["probabilities-also-output", "unscaled-by-a-vector",
                                    "wide-head"])
def test_an_attention_whose_steps_are_needed_elsewhere_keeps_its_kernels(change):
    """Softmax probabilities that are an output of their own, scores scaled by a tensor that
    is not one number, or a head wider than MAX_HEAD_WIDTH are not fused; the model still
    matches onnxruntime."""
    model = attention_model(output_probabilities=change == "probabilities-also-output",
                            depth=fuse_attention.MAX_HEAD_WIDTH + (change == "wide-head"))
    if change == "unscaled-by-a-vector":
        model.graph.initializer[0].CopyFrom(numpy_helper.from_array(
            np.linspace(0.2, 0.5, 5).astype(np.float32), "c"))
    package, scheduled = compile_keeping(model, SCHEDULED)
    names = kernel_names(scheduled)
    assert not any(name.startswith("attention") for name in names), names
    session = package.session()
    assert_matches(model, session, 6, 5 if change == "unscaled-by-a-vector" else 9)


def test_a_mask_that_broadcasts_the_scores_up_is_not_fused():
    """A mask of more batch axes than the scores makes the softmax's rows more than the
    kernel's (its batch is Q's): the attention stays unfused (it failed to compile, fused), and
    its scores' add runs after the GEMM kernel, not in its write-back."""
    model = attention_model(batch=(2, 3), mask=[5, 2, 3, "queries", "keys"])
    package, fused = compile_keeping(model, FUSED)
    assert not any(global_var.name_hint.startswith("attention")
                   for global_var in fused.functions), fused.functions.keys()
    session = package.session()
    assert_matches(model, session, LANES + 1, 7)


@pytest.fixture(scope="module")
def cross_attention():
    model = attention_model(batch=(2,), depth=8, values=5, perm=[1, 0, 2])
    return model, tightfit.compile(model).session()


@settings(max_examples=25, deadline=None)
@given(queries=st.integers(1, 3 * LANES + 3), keys=st.integers(1, 3 * LANES + 3))
def test_cross_attention_matches_onnxruntime_at_any_query_and_key_counts(cross_attention,
                                                                         queries, keys):
    """Queries and keys of different counts (cross-attention), any of each."""
    model, session = cross_attention
    assert_matches(model, session, queries, keys)


@given(values=st.integers(1, 300), lanes=st.sampled_from([4, 8, 16]))
def test_value_chunks_cover_the_columns_in_even_stack_sized_chunks(values, lanes):
    chunks = value_chunks(values, lanes)
    assert [start for start, _ in chunks] == list(np.cumsum([0] + [w for _, w in chunks[:-1]]))
    assert sum(width for _, width in chunks) == values
    assert all(width * lanes * 4 < 1024 for _, width in chunks)
    assert max(w for _, w in chunks) - min(w for _, w in chunks) <= len(chunks)
