"""Every version of every tightfit kernel matches onnxruntime, at the edges of its buckets.

A kernel over a symbolic row extent M has a row-tile version (M >= rows) and a single-row
version (M < rows), each serial and parallel (dispatch.py). The two knob databases below force
the parallel or the serial side of the work `if`, and the extents probe each row bucket at its
edges: 1, rows - 1, rows, rows + 1 (the last tile shifted back by one row), and a few tiles plus
a remainder.
"""

import re

import numpy as np
import onnx
import pytest
from hypothesis import given
from hypothesis import strategies as st
import tvm
from onnx import TensorProto, helper, numpy_helper

import tightfit
from tightfit.feeds import run_onnxruntime
from tightfit.frontend import import_onnx
from tightfit.passes.select_conv_algorithm import CONV_PANEL_WIDTH
from tightfit.schedules import conv2d, schedule_kernels
from tightfit.schedules.conv2d import FLAT_PIXELS_ANNOTATION
from tightfit.schedules.conv_cost import WINOGRAD_TILES
from tightfit.schedules.dispatch import row_buckets
from tightfit.pipeline import PipelineOptions, run_pipeline
from tightfit.schedules.isa import AVX2, AVX512, NEON, SSE, isa_for_target
from tightfit.schedules.knob_database import KnobDatabase
from tightfit.schedules.prefetch import (
    CACHE_LINE_BYTES,
    PREFETCH_CHANNELS_AHEAD,
    PREFETCH_MIN_CHANNELS,
    PREFETCH_MIN_WEIGHT_BYTES,
)
from tightfit.schedules import register_tile
from tightfit.schedules.register_tile import SYMBOLIC_COLUMNS, TileKnobs, default_tile_knobs
from tightfit.schedules.tail_tiles import rewrite_loop_nest
from tightfit.target import resolve_target
from tightfit.testing import zoo

from kernel_harness import AVX512_TARGET, SCHEDULED, compile_keeping, kernel_blocks, selected_algorithms

ARM64 = {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]}


def _model(name, nodes, inputs, outputs, initializers) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _weight(rng, name, shape) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)


def dense_model(columns: int) -> onnx.ModelProto:
    """x[m, 24] @ W[24, columns] + b, ReLU: the packed dense kernel with a fused epilogue."""
    rng = np.random.default_rng(0)
    return _model("dense", [helper.make_node("Gemm", ["x", "w", "b"], ["g"]),
                            helper.make_node("Relu", ["g"], ["y"])],
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", 24])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", columns])],
                  [_weight(rng, "w", (24, columns)), _weight(rng, "b", (columns,))])


def batched_matmul_model(columns: int) -> onnx.ModelProto:
    """a[2, m, 12] @ b[2, 12, columns], both at run time: the kernel that packs its right side."""
    return _model("batched_matmul", [helper.make_node("MatMul", ["a", "b"], ["y"])],
                  [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, "m", 12]),
                   helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 12, columns])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, "m", columns])], [])


def attention_scores_model() -> onnx.ModelProto:
    """q[2, s, 8] @ k[2, 8, s] / 2: attention's scores, columns as symbolic as the rows."""
    return _model("attention_scores", [helper.make_node("MatMul", ["q", "k"], ["scores"]),
                                       helper.make_node("Div", ["scores", "two"], ["y"])],
                  [helper.make_tensor_value_info("q", TensorProto.FLOAT, [2, "s", 8]),
                   helper.make_tensor_value_info("k", TensorProto.FLOAT, [2, 8, "s"])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, "s", "s"])],
                  [numpy_helper.from_array(np.array(2, np.float32), "two")])


def conv_model(channels: int, out_channels: int, groups: int, kernel: int = 3,
               stride: int = 1, pads: list[int] | None = None,
               height: int | str = 5, batch: int = 1) -> onnx.ModelProto:
    """kernel x kernel conv, same padding (or `pads`: top, left, bottom, right), over
    image[batch, channels, height, w], bias and ReLU fused; w is the row extent. kernel 1 is
    the pointwise case, which reads the input unpacked."""
    rng = np.random.default_rng(1)
    pads = [kernel // 2] * 4 if pads is None else pads
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[kernel, kernel],
                              pads=[pads[0], pads[1], pads[2], pads[3]], group=groups,
                              strides=[stride, stride]),
             helper.make_node("Relu", ["c"], ["y"])]
    return _model("conv", nodes,
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, channels, height, "w"])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, out_channels, None, None])],
                  [_weight(rng, "w", (out_channels, channels // groups, kernel, kernel)),
                   _weight(rng, "b", (out_channels,))])


def pointwise_residual_model(channels: int, out_channels: int) -> onnx.ModelProto:
    """1x1 conv + bias + a residual input, over image[n, channels, h, w] with all three dims
    symbolic: the pointwise kernel tiles each image's flattened h x w pixels."""
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[1, 1]),
             helper.make_node("Add", ["c", "r"], ["y"])]
    image = ["n", None, "h", "w"]
    return _model("pointwise_residual", nodes,
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [image[0], channels, *image[2:]]),
                   helper.make_tensor_value_info("r", TensorProto.FLOAT, [image[0], out_channels, *image[2:]])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [image[0], out_channels, *image[2:]])],
                  [_weight(rng, "w", (out_channels, channels, 1, 1)), _weight(rng, "b", (out_channels,))])


def conv1d_model(channels: int, out_channels: int, stride: int) -> onnx.ModelProto:
    """Conv1d (kernel 3, pad 1) over sequence[1, channels, w], as a speech front end."""
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[3], pads=[1, 1],
                              strides=[stride])]
    return _model("conv1d", nodes,
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, "w"])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, out_channels, "v"])],
                  [_weight(rng, "w", (out_channels, channels, 3)), _weight(rng, "b", (out_channels,))])


def row_edges(rows: int) -> list[int]:
    return sorted({1, max(1, rows - 1), rows, rows + 1, 3 * rows + 2})


def register_tile_edges(rows: int) -> list[int]:
    """row_edges and the edges of the short-tile version (register_tile.SHORT_ROW_TILES)."""
    short = register_tile.SHORT_TILE_ROWS
    return sorted(set(row_edges(rows)) | {short - 1, short, short + 1, 2 * short + 1})


def tile_rows(columns: int, panel_width: int | None = None, target="host") -> int:
    """The register tile's rows for `columns` output columns on `target` (no knob records)."""
    isa = isa_for_target(resolve_target(target).tvm_target)
    return default_tile_knobs(isa, columns, tvm.tirx.Var("m", "int64"), panel_width).rows


def assert_matches_onnxruntime(model, kernel, knob_database, feeds_at, extents,
                               conv_algorithms=None):
    options = PipelineOptions(knob_database=knob_database, conv_algorithms=conv_algorithms)
    package, scheduled = compile_keeping(model, SCHEDULED, options=options)
    assert kernel in kernel_blocks(scheduled), f"{model.graph.name} does not use {kernel}"
    session = package.session()
    for extent in extents:
        feeds = feeds_at(extent)
        expected = run_onnxruntime(model, feeds)
        ours = session.run(feeds)
        for name, value in expected.items():
            np.testing.assert_allclose(ours[name], value, rtol=1e-4, atol=1e-5,
                                       err_msg=f"{model.graph.name} at extent {extent}")


def _scheduled_kernel_func(model, kernel_name: str, knob_database: str,
                           conv_algorithms=None, target="host") -> tvm.tirx.PrimFunc:
    """`model`'s scheduled PrimFunc for `target` whose name holds `kernel_name`."""
    options = PipelineOptions(knob_database=knob_database, conv_algorithms=conv_algorithms)
    scheduled, _ = run_pipeline(import_onnx(model).mod, resolve_target(target), options,
                                stop_after="tightfit.FallbackCPUSchedule")
    return next(func for global_var, func in scheduled.functions.items()
                if kernel_name in global_var.name_hint)


def _scheduled_kernel(model, kernel_name: str, knob_database: str,
                      conv_algorithms=None) -> str:
    """The TVMScript of `model`'s scheduled PrimFunc whose name holds `kernel_name`."""
    return _scheduled_kernel_func(model, kernel_name, knob_database, conv_algorithms).script()


def _normal(*shape) -> np.ndarray:
    return np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("panels_outer", [False, True], ids=["row_tiles_outer", "panels_outer"])
@pytest.mark.parametrize("columns", [10, 40])
def test_dense_versions_match_onnxruntime_at_row_bucket_edges(knob_database, monkeypatch, columns,
                                                              panels_outer):
    """Both loop orders of the row-tile version: row tiles outermost (small weights), or column
    panels outermost (weights over the threshold, moved here to force it; one panel of 10
    columns stays row tiles outermost: there is nothing to share among threads)."""
    if panels_outer:
        monkeypatch.setattr(register_tile, "ROW_TILES_OUTER_MAX_WEIGHT_BYTES", 0)
    model = dense_model(columns)
    row_tiles_version = _scheduled_kernel(model, "dense_packed", knob_database)
    outermost = re.search(r"for (i0_0|i1_0)\b", row_tiles_version).group(1)
    assert outermost == ("i1_0" if panels_outer and columns > 32 else "i0_0")
    assert_matches_onnxruntime(model, "dense_packed", knob_database,
                               lambda m: {"x": _normal(m, 24)},
                               register_tile_edges(tile_rows(columns))
                               + [2 * tile_rows(columns) - 1, 2 * tile_rows(columns)])


def test_attention_scores_over_a_symbolic_sequence_match_onnxruntime(knob_database):
    """q[2, s, 8] @ k[2, 8, s] / 2, attention's scores: columns as symbolic as the rows. The panel
    is SYMBOLIC_COLUMNS wide (SelectGemmKernel; 32-wide panels did twice the work at 16
    tokens). Each row of k is packed a panel row per vector load, a masked one in the last panel
    (padding.vector_panel_rows), not a check per element; each score row is written with plain
    vector stores where whole and masked ones at the sequence's end, not a check per column.
    Every sequence across two panels and the row buckets' edges matches."""
    model = attention_scores_model()
    kernel = _scheduled_kernel(model, "matmul_packed_rhs", knob_database)
    lanes = isa_for_target(resolve_target("host").tvm_target).lanes
    assert f'"tightfit.vectors": {SYMBOLIC_COLUMNS // lanes}' in kernel
    assert "masked_load" in kernel and "if_then_else" not in kernel
    assert "masked_store" in kernel
    # (the division by the constant 2 is a multiplication by 0.5: UseFastMath)
    assert re.search(r"\n\s*T_multiply_intermediate\[[^\n]*\] = matmul_packed_rhs_out_row\[", kernel)
    extents = sorted(set(range(1, 4 * lanes + 2)) | set(register_tile_edges(tile_rows(lanes))))
    assert_matches_onnxruntime(model, "matmul_packed_rhs", knob_database,
                               lambda s: {"q": _normal(2, s, 8), "k": _normal(2, 8, s)}, extents)


def keys_transposed_model() -> onnx.ModelProto:
    """q[2, s, 8] @ Transpose(k[2, s, 8]) / 2: attention's scores over keys as they come."""
    return _model("keys_transposed",
                  [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
                   helper.make_node("MatMul", ["q", "kt"], ["scores"]),
                   helper.make_node("Div", ["scores", "two"], ["y"])],
                  [helper.make_tensor_value_info("q", TensorProto.FLOAT, [2, "s", 8]),
                   helper.make_tensor_value_info("k", TensorProto.FLOAT, [2, "s", 8])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, "s", "s"])],
                  [numpy_helper.from_array(np.array(2, np.float32), "two")])


def test_transposed_keys_are_packed_from_their_own_layout(knob_database):
    """matmul(q, permute_dims(k)) with the last two axes swapped packs k's rows into the
    kernel's panels itself (SelectGemmKernel): no transpose kernel remains, and every sequence
    across two panels and the row buckets' edges matches onnxruntime."""
    model = keys_transposed_model()
    scheduled, _ = run_pipeline(import_onnx(model).mod, resolve_target("host"),
                                PipelineOptions(knob_database=knob_database),
                                stop_after="tightfit.FallbackCPUSchedule")
    kernels = [gv.name_hint for gv, func in scheduled.functions.items()
               if isinstance(func, tvm.tirx.PrimFunc)]
    assert not any("transpose" in name for name in kernels), kernels
    lanes = isa_for_target(resolve_target("host").tvm_target).lanes
    extents = sorted(set(range(1, 2 * lanes + 2)) | set(register_tile_edges(tile_rows(lanes))))
    assert_matches_onnxruntime(model, "matmul_packed_rhs", knob_database,
                               lambda s: {"q": _normal(2, s, 8), "k": _normal(2, s, 8)}, extents)


def head_merge_model(perm: list[int], extra_use: bool = False) -> onnx.ModelProto:
    """p[2, 3, s, s] @ v[2, 3, s, 8], then Transpose(perm): attention's weighted values, their
    heads merged (perm [0, 2, 1, 3]). `extra_use`: the product is an output of its own too."""
    nodes = [helper.make_node("MatMul", ["p", "v"], ["o"]),
             helper.make_node("Transpose", ["o"], ["y"], perm=perm)]
    product = [2, 3, "s", 8]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [product[a] for a in perm])]
    if extra_use:
        outputs.append(helper.make_tensor_value_info("o", TensorProto.FLOAT, product))
    return _model("head_merge", nodes,
                  [helper.make_tensor_value_info("p", TensorProto.FLOAT, [2, 3, "s", "s"]),
                   helper.make_tensor_value_info("v", TensorProto.FLOAT, [2, 3, "s", 8])],
                  outputs, [])


@pytest.mark.parametrize("perm, folded", [([0, 2, 1, 3], True), ([2, 0, 1, 3], True),
                                          ([0, 1, 3, 2], False)],
                         ids=["head-merge", "sequence-first", "last-axis-moved"])
@pytest.mark.parametrize("extra_use", [False, True], ids=["one-use", "product-also-output"])
def test_a_transpose_after_a_matmul_is_done_by_its_write_back(knob_database, perm, folded,
                                                              extra_use):
    """A Transpose of a run-time matmul's product that keeps the columns last is the kernel's
    write-back storing its rows in the transposed order (SelectGemmKernel): no transpose kernel
    remains. Not where the Transpose moves the columns, or the product has another use. Every
    sequence length across the row buckets' edges matches onnxruntime either way."""
    model = head_merge_model(perm, extra_use)
    options = PipelineOptions(knob_database=knob_database)
    scheduled, _ = run_pipeline(import_onnx(model).mod, resolve_target("host"), options,
                                stop_after="tightfit.FallbackCPUSchedule")
    kernels = [gv.name_hint for gv, func in scheduled.functions.items()
               if isinstance(func, tvm.tirx.PrimFunc)]
    assert any("matmul_packed_rhs" in name for name in kernels), kernels
    assert any("transpose" in name for name in kernels) != (folded and not extra_use), kernels
    extents = sorted(set(range(1, 6)) | set(register_tile_edges(tile_rows(8))))
    assert_matches_onnxruntime(model, "matmul_packed_rhs", knob_database,
                               lambda s: {"p": _normal(2, 3, s, s), "v": _normal(2, 3, s, 8)},
                               extents)


def _unrolled_loops_run_at(func: tvm.tirx.PrimFunc, extent: int) -> list[int]:
    """The extents of the unrolled loops (a register tile's rows and vectors) of the version
    that `func`'s dispatch picks with every symbolic dim at `extent`."""
    analyzer = tvm.sym.Analyzer()
    for buffer in func.params:
        for dim in buffer.shape:
            for var in tvm.tirx.analysis.undefined_vars(dim):
                analyzer.bind(var, extent)
    stmt = func.body
    while not (isinstance(stmt, tvm.s_tir.SBlockRealize)
               and stmt.block.name_hint.startswith("version_")):
        if isinstance(stmt, tvm.tirx.IfThenElse):
            stmt = stmt.then_case if bool(analyzer.simplify(stmt.condition)) else stmt.else_case
        else:
            stmt = stmt.block.body
    unrolled = []
    rewrite_loop_nest(stmt.block.body, lambda realize: realize, on_enter_for=lambda loop: (
        unrolled.append(int(loop.extent)) if loop.kind == tvm.tirx.ForKind.UNROLLED else None))
    return unrolled


@pytest.mark.parametrize("tokens, long_tiles", [(14, False), (15, True), (16, False), (30, True),
                                                (31, False)])
def test_attention_scores_take_short_tiles_where_long_ones_compute_many_rows_twice(
        knob_database, tokens, long_tiles):
    """Past a tile's rows, a GEMM's long tiles run only where they cost less than short ones
    (register_tile.version_slots), as a direct conv's do: 16 tokens in 15-row tiles
    computed 30 rows (transformer_encoder_dynamo at 3x16, whole run: 36.99 -> 30.34 us). The
    token counts are those of AVX-512's 15-row tiles: scheduled for AVX-512 on any host."""
    func = _scheduled_kernel_func(attention_scores_model(), "matmul_packed_rhs", knob_database,
                                  target=AVX512_TARGET)
    assert max(_unrolled_loops_run_at(func, tokens)) == (
        tile_rows(SYMBOLIC_COLUMNS, target=AVX512_TARGET) if long_tiles
        else register_tile.SHORT_TILE_ROWS)


@pytest.mark.parametrize("columns, rows, one_at_a_time", [
    (96, 4, False), (96, 5, True), (96, 6, True), (96, 8, False), (96, 9, True), (32, 5, False)])
def test_a_gemm_runs_few_rows_one_at_a_time_where_short_tiles_compute_many_twice(
        knob_database, columns, rows, one_at_a_time):
    """Below a tile's rows, a GEMM runs one row at a time across several of its weight's panels
    (register_tile.single_row_knobs) where that takes fewer issue slots than 4-row tiles, which
    cover 5 rows in 8 (register_tile.version_slots): 96 columns at 5, 6 and 9 rows; 4-row
    tiles at 4 and 8 rows, and over 32 columns, where one row has too few chains. The row
    counts are those of AVX-512's tiles: scheduled for AVX-512 on any host, run on the host."""
    func = _scheduled_kernel_func(dense_model(columns), "dense_packed", knob_database,
                                  target=AVX512_TARGET)
    unrolled = _unrolled_loops_run_at(func, rows)
    assert (register_tile.SHORT_TILE_ROWS not in unrolled) == one_at_a_time
    if one_at_a_time:
        assert max(unrolled) == columns // AVX512.lanes  # every panel in one row's chains
    assert_matches_onnxruntime(dense_model(columns), "dense_packed", knob_database,
                               lambda m: {"x": _normal(m, 24)}, [rows])


def test_an_epilogue_reading_a_value_twice_is_computed_in_the_write_back(knob_database):
    """GELU after a GEMM, as exporters write it: x * 0.5 * (1 + erf(x / sqrt 2)) reads x in its
    first and last op. Its ops are inlined into the kernel's write-back instead of each running
    as a loop over the whole output (BERT-mini's 256 -> 1024 + GELU at 128 tokens: 400 ->
    176 us), at every row bucket edge."""
    rng = np.random.default_rng(7)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Div", ["h", "sqrt2"], ["scaled"]),
             helper.make_node("Erf", ["scaled"], ["erf"]),
             helper.make_node("Add", ["erf", "one"], ["shifted"]),
             helper.make_node("Mul", ["h", "shifted"], ["doubled"]),
             helper.make_node("Mul", ["doubled", "half"], ["y"])]
    scalars = [numpy_helper.from_array(np.array(value, np.float32), name)
               for name, value in (("sqrt2", np.sqrt(2)), ("one", 1.0), ("half", 0.5))]
    model = _model("gelu_mlp", nodes,
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", 24])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", 40])],
                   [_weight(rng, "w", (24, 40)), *scalars])
    kernel = _scheduled_kernel(model, "dense_packed", knob_database)
    blocks = set(re.findall(r'T\.sblock\("(\w+)"\)', kernel)) - {"root"}
    assert {block for block in blocks if not block.startswith("version_")} == {
        "dense_packed_tiles_init", "dense_packed_tiles_update", "dense_packed_out"}
    assert_matches_onnxruntime(model, "dense_packed", knob_database,
                               lambda m: {"x": _normal(m, 24)},
                               register_tile_edges(tile_rows(40)))


def test_an_add_that_broadcasts_the_product_up_stays_outside_the_write_back(knob_database):
    """[1,3,m,8] @ [1,3,8,12] + [2,3,m,12]: the add visits every product twice, so it cannot be
    the kernel's store (ScheduleKernels failed on it with "Cannot dispatch a null
    expression"); it runs as a loop of its own over the kernel's output, at every row bucket
    edge."""
    model = _model("broadcast_up", [helper.make_node("MatMul", ["a", "b"], ["p"]),
                                    helper.make_node("Add", ["p", "mask"], ["y"])],
                   [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, 3, "m", 8]),
                    helper.make_tensor_value_info("b", TensorProto.FLOAT, [1, 3, 8, 12]),
                    helper.make_tensor_value_info("mask", TensorProto.FLOAT, [2, 3, "m", 12])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, "m", 12])], [])
    kernel = _scheduled_kernel(model, "matmul_packed_rhs", knob_database)
    assert re.search(r'T\.sblock\("T_add', kernel), "the add is not a loop of its own"
    assert_matches_onnxruntime(
        model, "matmul_packed_rhs", knob_database,
        lambda m: {"a": _normal(1, 3, m, 8), "b": _normal(1, 3, 8, 12),
                   "mask": _normal(2, 3, m, 12)},
        register_tile_edges(tile_rows(12)))


def test_skinny_dense_spends_the_registers_on_vectors_and_runs_over_panels(knob_database):
    """A GEMV-like layer (one row: a classifier at batch 1) in panels of up to 8 vectors, as
    many independent FMA chains as the registers hold (8 on AVX-512, 7 of AVX2's 16 registers),
    its panels outermost so that they can share the threads (it ran on one thread in 2-vector
    panels: MobileNetV2's 1280 -> 1000 classifier 183 -> 65 us); 4 rows: as many vectors as the
    stack array allows."""
    isa = isa_for_target(resolve_target("host").tvm_target)
    one_row = default_tile_knobs(isa, 300, 1)
    assert one_row.rows == 1 and isa.fits_registers(1, one_row.vectors)
    assert (one_row.vectors == min(register_tile.SKINNY_VECTORS, -(-300 // isa.lanes))
            or not isa.fits_registers(1, one_row.vectors + 1))
    assert one_row.vectors > 2
    four_rows = default_tile_knobs(isa, 300, 4)
    assert four_rows.rows == 4 and isa.fits_registers(4, four_rows.vectors)
    assert not isa.fits_registers(4, four_rows.vectors + 1)
    rng = np.random.default_rng(5)
    model = _model("classifier", [helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 300])],
                   [_weight(rng, "w", (300, 64)), _weight(rng, "b", (300,))])
    kernel = _scheduled_kernel(model, "dense_packed", knob_database)
    assert re.search(r"for (i0_0|i1_0)\b", kernel).group(1) == "i1_0"
    panels = -(-300 // (default_tile_knobs(isa, 300, 1).vectors * isa.lanes))
    parallel = f"for i1_0 in T.parallel(T.int64({panels}))"
    assert (parallel in kernel) == knob_database.endswith("parallel.json")
    options = PipelineOptions(knob_database=knob_database)
    feeds = {"x": _normal(1, 64)}
    np.testing.assert_allclose(tightfit.compile(model, options=options).session().run(feeds)["y"],
                               run_onnxruntime(model, feeds)["y"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("channels, kernel, stride", [(4, 3, 1), (4, 1, 1), (32, 3, 2)])
def test_direct_conv_versions_match_onnxruntime_at_width_bucket_edges(knob_database, channels,
                                                                      kernel, stride):
    """32 channels 3x3 stride 2: where the cost model picks the direct kernel (ResNet's
    downsampling convs, conv_cost.DIRECT_EFFICIENCY_BY_CHANNELS). Beyond a tile the long
    tiles run only where they cost less than short ones (version_slots): at a tile's
    width, and two tiles' less one (a shifted last tile)."""
    rows = tile_rows(24, CONV_PANEL_WIDTH)
    widths = sorted({stride * (edge - 1) + 1
                     for edge in register_tile_edges(rows) + [2 * rows - 1, 2 * rows]})
    assert_matches_onnxruntime(conv_model(channels, 24, groups=1, kernel=kernel, stride=stride),
                               "conv2d_direct", knob_database,
                               lambda w: {"x": _normal(1, channels, 5, w)}, widths,
                               conv_algorithms=("direct",))


def test_direct_conv_weights_over_the_threshold_prefetch_their_rows_channels_ahead(knob_database):
    """A direct conv whose packed weight is PREFETCH_MIN_WEIGHT_BYTES or more asks, at each
    input channel's step, for its panel's row PREFETCH_CHANNELS_AHEAD channels on, in every
    version (the tiles' reduction unrolled or not); one with a quarter of the output channels
    asks for nothing; the output still matches onnxruntime at widths of each version."""
    channels = 64
    out_channels = PREFETCH_MIN_WEIGHT_BYTES // 4 // (9 * channels)
    model = conv_model(channels, out_channels, groups=1, stride=2)
    kernel = _scheduled_kernel(model, "conv2d", knob_database, ("direct",))
    ahead = re.findall(r'"llvm.prefetch", T.address_of\(w_panels\[.*?, rc(?:_0)? \+ T.int64\((\d+)\), ',
                       kernel)
    assert len(ahead) >= 3 and {int(channels) for channels in ahead} == {PREFETCH_CHANNELS_AHEAD}
    assert "llvm.prefetch" not in _scheduled_kernel(
        conv_model(channels, out_channels // 4, groups=1, stride=2), "conv2d", knob_database,
        ("direct",))
    rows = tile_rows(out_channels, CONV_PANEL_WIDTH)
    assert_matches_onnxruntime(model, "conv2d_direct", knob_database,
                               lambda w: {"x": _normal(1, channels, 5, w)},
                               [1, 2 * rows - 1, 2 * rows + 5], conv_algorithms=("direct",))


@pytest.mark.parametrize("out_width, short", [(15, False), (16, True), (20, True), (30, False),
                                               (31, True)])
def test_short_tiles_run_where_long_ones_would_compute_many_rows_twice(out_width, short):
    """ResNet-18's 64 -> 128 stride-2 conv, 15-row tiles of one vector against 4 x 2 short
    tiles: a 16-wide row in long tiles computes 30 rows (1 thread: 315 against 189 us), a 30-wide
    one none twice (609 against 700 us); a symbolic width gets the same test at run time."""
    knobs, isa = TileKnobs(rows=15, vectors=1), AVX512  # the measured tiles are AVX-512's
    tiles = {register_tile.ROW_TILES: knobs,
             register_tile.SHORT_ROW_TILES: register_tile.short_tile_knobs(knobs, 128, isa)}

    def slots(version, extent):  # a conv's single rows are not costed (schedule_kernels.py)
        return register_tile.version_slots(extent, tiles[version], 128, isa) \
            if version in tiles else None

    expected = register_tile.SHORT_ROW_TILES if short else register_tile.ROW_TILES
    assert row_buckets(out_width, 15, register_tile.SHORT_TILE_ROWS, slots) == [(expected, None)]
    width = tvm.tirx.Var("ow", "int64")
    analyzer = tvm.sym.Analyzer()
    analyzer.bind(width, out_width)
    chosen = next(version for version, condition in row_buckets(
        width, 15, register_tile.SHORT_TILE_ROWS, slots)
        if condition is None or bool(analyzer.simplify(condition)))
    assert chosen == expected


def test_short_tiles_cover_a_narrow_map_once(knob_database):
    """The short-tile version of a direct conv runs ceil(OW / SHORT_TILE_ROWS) tiles along a
    row. Its tiles' domain is max(OW, rows) wide (conv2d.conv2d_direct), so the split alone
    would run ceil(max(OW, rows) / 4) tiles, the shifted last one again and again: correct
    outputs, 3-4x the work on ResNet-18's 4x4 maps."""
    kernel = _scheduled_kernel_func(conv_model(32, 24, groups=1, kernel=3, stride=2),
                                    "conv2d_direct", knob_database, ("direct",))
    short = register_tile.SHORT_TILE_ROWS
    tile_loops, loops_seen = [], []

    def note_tile_loop(loop):
        # conv2d_direct's tiles run along its `ow` axis, split into tiles (ow_0) of rows (ow_1)
        loops_seen.append(loop)
        if loop.loop_var.name == "ow_1_init" and int(loop.extent) == short:
            tile_loops.append(next(outer.extent for outer in reversed(loops_seen)
                                   if outer.loop_var.name == "ow_0"))

    rewrite_loop_nest(kernel.body, lambda realize: realize, on_enter_for=note_tile_loop)
    assert tile_loops, "no short-tile version"
    width = next(iter(tvm.tirx.analysis.undefined_vars(tile_loops[0])))
    for out_width in range(short, tile_rows(24, CONV_PANEL_WIDTH)):
        analyzer = tvm.sym.Analyzer()
        analyzer.bind(width, 2 * out_width - 1)
        assert {int(analyzer.simplify(extent)) for extent in tile_loops} == {-(-out_width // short)}


@pytest.mark.parametrize("width", [1, 4, 7])
def test_a_narrow_static_map_reads_several_conv_panels_at_a_time(knob_database, width):
    """A direct conv over a static map narrower than a tile: its rows are the tile's height and
    its weight panels are read together, enough for register_tile.SKINNY_VECTORS independent
    multiply-add chains where the output channels make that many panels and the registers hold
    them (ResNet-18's 512 -> 512 3x3 convs at a static 4x4 ran 4 x 1 tiles: 293 -> 187 us
    each); the outputs still match onnxruntime. A map as wide as the host's tile (7 columns
    against AVX2's 6 rows, in 16 registers) gets a tile's rows or fewer."""
    isa = isa_for_target(resolve_target("host").tvm_target)
    tile_rows = default_tile_knobs(isa, 64, None, CONV_PANEL_WIDTH).rows
    knobs = default_tile_knobs(isa, 64, width, CONV_PANEL_WIDTH)
    assert isa.fits_registers(knobs.rows, knobs.vectors) and 64 % (knobs.vectors * isa.lanes) == 0
    if width < tile_rows:
        wider_fitting = [v for v in range(knobs.vectors + 1, register_tile.SKINNY_VECTORS + 1)
                         if 64 % (v * isa.lanes) == 0 and isa.fits_registers(width, v)]
        assert knobs.rows == width
        assert (knobs.rows * knobs.vectors >= min(register_tile.SKINNY_VECTORS,
                                                  width * 64 // isa.lanes) or not wider_fitting)
    else:
        assert knobs.rows <= tile_rows
    model = conv_model(32, 64, groups=1, height=3)
    model.graph.input[0].type.tensor_type.shape.dim[3].dim_value = width
    options = PipelineOptions(knob_database=knob_database, conv_algorithms=("direct",))
    feeds = {"x": _normal(1, 32, 3, width)}
    np.testing.assert_allclose(tightfit.compile(model, options=options).session().run(feeds)["y"],
                               run_onnxruntime(model, feeds)["y"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kernel, stride", [(3, 1), (1, 1), (3, 2), (1, 2)])
def test_width_vectors_conv_versions_match_onnxruntime_at_vector_edges(knob_database, kernel,
                                                                       stride):
    """Output widths at the vector edges; 17 output channels are not a whole number of
    channel-row tiles, so the last tile's padded channels are computed and not written."""
    lanes = isa_for_target(resolve_target("host").tvm_target).lanes
    widths = sorted({(stride * (edge - 1) + 1) for edge in row_edges(lanes)} | {stride * lanes})
    assert_matches_onnxruntime(conv_model(4, 17, groups=1, kernel=kernel, stride=stride),
                               "conv2d_width_vectors", knob_database,
                               lambda w: {"x": _normal(1, 4, 5, w)}, widths)


@pytest.mark.parametrize("stride", [1, 2])
def test_im2col_conv_matches_onnxruntime_at_pixel_plane_edges(knob_database, stride):
    """Explicit im2col + GEMM: an unfolding kernel, then the pointwise width-vectors GEMM along
    the flattened output pixels, at output planes a vector (16 lanes: 5 rows x 3 or 4 columns)
    less, equal or more wide."""
    lanes = isa_for_target(resolve_target("host").tvm_target).lanes
    widths = sorted({(stride * (edge - 1) + 1) for edge in row_edges(lanes)} | {stride * lanes})
    model = conv_model(4, 17, groups=1, kernel=3, stride=stride)
    assert "im2col" in _scheduled_kernel(model, "im2col", knob_database, conv_algorithms=("im2col",))
    assert_matches_onnxruntime(model, "conv2d_width_vectors", knob_database,
                               lambda w: {"x": _normal(1, 4, 5, w)}, widths,
                               conv_algorithms=("im2col",))


def test_a_conv_no_allowed_algorithm_applies_to_keeps_its_own_candidates():
    """Forcing im2col (for comparing kernels) on a model with a pointwise conv, which im2col
    does not unfold: that conv gets the width kernel, the 3x3 one im2col."""
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c"], kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Conv", ["c", "w2"], ["y"], kernel_shape=[1, 1])]
    model = _model("conv_pair", nodes,
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 5, "w"])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 5, "w"])],
                   [_weight(rng, "w1", (8, 4, 3, 3)), _weight(rng, "w2", (8, 8, 1, 1))])
    options = PipelineOptions(conv_algorithms=("im2col",))
    selected, _ = run_pipeline(import_onnx(model).mod, resolve_target("host"), options,
                               stop_after="tightfit.SelectConvAlgorithm")
    assert selected_algorithms(selected) == ["im2col", "width_vectors"]
    feeds = {"x": _normal(1, 4, 5, 9)}
    np.testing.assert_allclose(tightfit.compile(model, options=options).session().run(feeds)["y"],
                               run_onnxruntime(model, feeds)["y"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("channels, out_channels, groups, kernel, stride", [
    (16, 16, 4, 3, 1),  # ResNeXt's grouped 3x3
    (12, 24, 3, 1, 1),  # ShuffleNet's grouped 1x1 (pointwise: tiles along the pixel plane)
    (8, 12, 2, 3, 2),
    (4, 8, 4, 3, 1),  # depthwise with a channel multiplier of 2: one input channel per group
], ids=["resnext_3x3", "shufflenet_1x1", "strided", "depthwise_multiplier_2"])
def test_grouped_conv_versions_match_onnxruntime_at_vector_edges(knob_database, channels,
                                                                 out_channels, groups, kernel,
                                                                 stride):
    """A grouped conv runs the width-vectors kernel, each tile reading its own group's input
    channels; the widths probe every version as the ungrouped test does."""
    lanes = isa_for_target(resolve_target("host").tvm_target).lanes
    widths = sorted({(stride * (edge - 1) + 1) for edge in row_edges(lanes)} | {stride * lanes})
    assert_matches_onnxruntime(
        conv_model(channels, out_channels, groups=groups, kernel=kernel, stride=stride),
        "conv2d_width_vectors", knob_database, lambda w: {"x": _normal(1, channels, 5, w)}, widths)


@pytest.mark.parametrize("groups, recorded_rows, used_rows", [(1, 5, 5), (4, 3, None)],
                         ids=["ungrouped_record_used", "grouped_record_straddling_ignored"])
def test_width_tile_records_apply_unless_a_tile_would_straddle_groups(tmp_path, groups,
                                                                      recorded_rows, used_rows):
    """A knob database's width-vectors record is used as measured, padded channels and all (5
    rows for 16 channels); for a grouped conv, rows that do not divide a group's channels (3
    for groups of 4) give way to the defaults, which do."""
    isa = isa_for_target(resolve_target("host").tvm_target)
    path = tmp_path / "knobs.json"
    database = KnobDatabase.open(path, resolve_target("host").tvm_target)
    database.record_tiles(conv2d.WIDTH_VECTORS, 16, tvm.tirx.Var("w", "int64"), isa,
                          TileKnobs(recorded_rows, 1), 1.0, "test")
    database.save()
    model = conv_model(16, 16, groups=groups)
    text = _scheduled_kernel(model, "conv2d_width_vectors", str(path))
    rows = int(re.search(r'"tightfit.channel_rows": (\d+)', text).group(1))
    assert rows == used_rows if used_rows else (16 // groups) % rows == 0
    assert_matches_onnxruntime(model, "conv2d_width_vectors", str(path),
                               lambda w: {"x": _normal(1, 16, 5, w)}, [3, 17])


@pytest.mark.parametrize("mcpu, vectors", [("haswell", 2), ("skylake-avx512", 1)],
                         ids=["avx2", "avx512"])
def test_width_tiles_are_two_vectors_where_each_broadcast_costs_a_load(mcpu, vectors):
    """A 3x3 conv's width tiles: one vector where a multiply-add reads its broadcast weight from
    memory (AVX-512, NEON), two on AVX2, where each channel row's weight is a load of its own
    (conv2d.width_tile_knobs). The AVX2 kernel runs on any x86-64 host with AVX2 and matches
    onnxruntime across its 16-column tiles' edges."""
    target = {"kind": "llvm", "mcpu": mcpu, "num-cores": 2}
    assert conv2d.width_tile_knobs(isa_for_target(tvm.target.Target(target)), 16).vectors == vectors
    model = conv_model(16, 16, groups=1)
    options = PipelineOptions(conv_algorithms=("width_vectors",))
    scheduled, _ = run_pipeline(import_onnx(model).mod, resolve_target(target), options,
                                stop_after="tightfit.FallbackCPUSchedule")
    assert f'"tightfit.vectors": {vectors}' in scheduled.script()
    host = resolve_target("host").tvm_target
    if mcpu != "haswell" or not tvm.target.codegen.target_has_features("avx2", host):
        return
    session = tightfit.compile(model, target, options=options).session()
    for width in [1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 40]:
        feeds = {"x": _normal(1, 16, 5, width)}
        np.testing.assert_allclose(session.run(feeds)["y"], run_onnxruntime(model, feeds)["y"],
                                   rtol=1e-4, atol=1e-4, err_msg=f"width {width}")


@given(groups=st.integers(2, 64), group_out_channels=st.integers(1, 96),
       pointwise_weight_bytes=st.sampled_from([None, 1 << 10, 1 << 20]))
def test_grouped_width_tiles_never_straddle_two_groups(groups, group_out_channels,
                                                        pointwise_weight_bytes):
    isa = isa_for_target(resolve_target("host").tvm_target)
    knobs = conv2d.width_tile_knobs(isa, groups * group_out_channels, pointwise_weight_bytes,
                                    groups)
    assert group_out_channels % knobs.rows == 0
    assert isa.fits_registers(knobs.rows, knobs.vectors)


@pytest.mark.parametrize("panels_outer", [False, True], ids=["pixel_tiles_outer", "panels_outer"])
def test_pointwise_conv_versions_match_onnxruntime_at_pixel_plane_edges(knob_database, monkeypatch,
                                                                        panels_outer):
    """Pixel planes (h x w) of one tile less, one, one more and three plus two, in shapes whose
    rows are narrower than a tile (7 x 7 is three vectors and a shifted tail), and a vector
    less or more, two images: the tiles run along each image's flattened pixels, in both loop
    orders (the weight size picks one; the threshold is moved to force the other), two vectors
    wide where the weights are small (width_tile_knobs), else one."""
    if panels_outer:
        monkeypatch.setattr(conv2d, "ROW_TILES_OUTER_MAX_WEIGHT_BYTES", 0)
    lanes = isa_for_target(resolve_target("host").tvm_target).lanes
    knobs = conv2d.width_tile_knobs(isa_for_target(resolve_target("host").tvm_target), 17, 17 * 6 * 4)
    assert knobs.vectors == (1 if panels_outer else 2)
    tile = knobs.vectors * lanes
    planes = [(1, 1), (1, tile - 1), (4, tile // 4), (tile + 1, 1), (7, 7), (5, (3 * tile + 2) // 5 + 1),
              (1, lanes - 1), (lanes + 1, 1)]
    model = pointwise_residual_model(6, 17)
    scheduled, _ = run_pipeline(import_onnx(model).mod, resolve_target("host"),
                                stop_after="tightfit.FallbackCPUSchedule")
    assert FLAT_PIXELS_ANNOTATION in scheduled.script()
    # the parallel loop fuses (image, pixel tile, channel panel) in the order asked for
    order = "n_o_0_p_0_fused" if panels_outer else "n_p_0_o_0_fused"
    assert f"for {order} in T.parallel" in scheduled.script()
    assert_matches_onnxruntime(model, "conv2d_width_vectors", knob_database,
                               lambda plane: {"x": _normal(2, 6, *plane), "r": _normal(2, 17, *plane)},
                               planes, conv_algorithms=("width_vectors",))


@pytest.mark.parametrize("panels_outer", [False, True], ids=["pixel_tiles_outer", "panels_outer"])
def test_long_pointwise_reductions_prefetch_the_tile_channels_ahead(knob_database, monkeypatch,
                                                                   panels_outer):
    """A pointwise conv over PREFETCH_MIN_CHANNELS channels asks, at each channel, for the
    tile's pixels PREFETCH_CHANNELS_AHEAD channels on (past the last channel near the end: a
    prefetch cannot fault): the first and last pixel of each line-long run of them (a run of
    16 floats lies on one line or two), and still matches onnxruntime over two images at pixel
    planes around the tile's edges; one channel fewer asks for nothing."""
    if panels_outer:
        monkeypatch.setattr(conv2d, "ROW_TILES_OUTER_MAX_WEIGHT_BYTES", 0)
    lanes = isa_for_target(resolve_target("host").tvm_target).lanes
    model = pointwise_residual_model(PREFETCH_MIN_CHANNELS, 17)
    kernel = _scheduled_kernel(model, "conv2d", knob_database, ("width_vectors",))
    # x[image, channel, row, column]; the image is the parallel loop's first part
    prefetched = re.findall(r'"llvm.prefetch", T.address_of\(x\[[^\[\]]*?, rc \+ T.int64\((\d+)\), '
                            r'(.*?) // w,', kernel)
    assert {int(ahead) for ahead, _ in prefetched} == {PREFETCH_CHANNELS_AHEAD}
    # in each version with pixel tiles (parallel, serial): each run's first and last pixel
    offsets = [int(next(iter(re.findall(r"\+ T.int64\((\d+)\)\)$", pixel)), 0))
               for _, pixel in prefetched]
    tile_pixels = (1 if panels_outer else 2) * lanes
    line = CACHE_LINE_BYTES // 4
    tile_ends = sorted(end for first in range(0, tile_pixels, line)
                       for end in (first, min(first + line, tile_pixels) - 1))
    assert sorted(set(offsets)) == tile_ends and len(offsets) % len(tile_ends) == 0
    assert "llvm.prefetch" not in _scheduled_kernel(
        pointwise_residual_model(PREFETCH_MIN_CHANNELS - 1, 17), "conv2d", knob_database,
        ("width_vectors",))
    assert_matches_onnxruntime(model, "conv2d_width_vectors", knob_database,
                               lambda plane: {"x": _normal(2, PREFETCH_MIN_CHANNELS, *plane),
                                              "r": _normal(2, 17, *plane)},
                               [(1, lanes), (4, lanes // 4 + 1), (7, 7), (3, 2 * lanes + 1)],
                               conv_algorithms=("width_vectors",))


@pytest.mark.parametrize("channels", [128, PREFETCH_MIN_CHANNELS],
                         ids=["row_tiles", "channel_vectors"])
def test_pointwise_weights_over_the_threshold_prefetch_their_rows_channels_ahead(knob_database,
                                                                                channels):
    """Packed weights of PREFETCH_MIN_WEIGHT_BYTES or more: each channel's step asks for its
    weight panel's row PREFETCH_CHANNELS_AHEAD channels on, in either tile form; a quarter of
    the output channels (weights under the threshold) asks for no weight, while a reduction
    over PREFETCH_MIN_CHANNELS still asks for its input; the output still matches onnxruntime
    over two images around the tile edges."""
    out_channels = PREFETCH_MIN_WEIGHT_BYTES // 4 // channels
    model = pointwise_residual_model(channels, out_channels)
    kernel = _scheduled_kernel(model, "conv2d", knob_database, ("width_vectors",))
    ahead = re.findall(r'"llvm.prefetch", T.address_of\(w_rows\[.*?, rc \+ T.int64\((\d+)\), '
                       r'T.int64\((\d+)\)\]\)', kernel)
    assert ahead and {int(channels) for channels, _ in ahead} == {PREFETCH_CHANNELS_AHEAD}
    if channels >= conv2d.CHANNEL_VECTORS_MIN_CHANNELS:
        # a 16-float panel row starts a line (the weight file aligns its blobs): one prefetch
        assert {int(lane) for _, lane in ahead} == {0}
    small = _scheduled_kernel(pointwise_residual_model(channels, out_channels // 4), "conv2d",
                              knob_database, ("width_vectors",))
    assert "address_of(w_rows" not in small
    assert ("address_of(x[" in small) == (channels >= PREFETCH_MIN_CHANNELS)
    lanes = isa_for_target(resolve_target("host").tvm_target).lanes
    assert_matches_onnxruntime(model, "conv2d_width_vectors", knob_database,
                               lambda plane: {"x": _normal(2, channels, *plane),
                                              "r": _normal(2, out_channels, *plane)},
                               [(1, lanes), (7, 7), (3, 2 * lanes + 1)],
                               conv_algorithms=("width_vectors",))


@pytest.mark.parametrize("out_channels", [32, 48], ids=["two_panels_a_tile", "one_panel_a_tile"])
def test_channel_vector_pointwise_conv_matches_onnxruntime_at_pixel_tile_edges(knob_database,
                                                                              out_channels):
    """A pointwise conv over CHANNEL_VECTORS_MIN_CHANNELS channels runs CHANNEL_VECTORS: the
    vectors along 16-channel panels (two a tile where they pair up), the tiles over the flat
    pixels, threads over images, channel tiles and pixel tiles together. Planes of one pixel and
    of a tile less (one pixel at a time), a tile, a tile and one, 7x7, 5x4 and 14x14 (the last
    tile shifted back), two images, with a residual input in the epilogue."""
    lanes = isa_for_target(resolve_target("host").tvm_target).lanes
    panels, pixels = conv2d.channel_vector_tile(isa_for_target(resolve_target("host").tvm_target),
                                                out_channels)
    assert panels == (2 if out_channels == 32 and lanes == 16 else 1)
    model = pointwise_residual_model(conv2d.CHANNEL_VECTORS_MIN_CHANNELS, out_channels)
    kernel = _scheduled_kernel(model, "conv2d", knob_database)
    assert '"tightfit.channel_vectors": True' in kernel
    # images, channel tiles and pixel tiles share the threads (the serial database's kernel
    # keeps a parallel version too: its work is symbolic)
    assert "for n_o_0_p_0_fused in T.parallel" in kernel
    planes = [(1, 1), (1, pixels - 1), (1, pixels), (1, pixels + 1), (7, 7), (5, 4), (14, 14)]
    assert_matches_onnxruntime(model, "conv2d_width_vectors", knob_database,
                               lambda plane: {"x": _normal(2, conv2d.CHANNEL_VECTORS_MIN_CHANNELS,
                                                           *plane),
                                              "r": _normal(2, out_channels, *plane)},
                               planes)


@pytest.mark.parametrize("in_channels, out_channels", [(conv2d.CHANNEL_VECTORS_MIN_CHANNELS - 1, 32),
                                                       (conv2d.CHANNEL_VECTORS_MIN_CHANNELS, 40)],
                         ids=["short_reduction", "channels_not_whole_panels"])
def test_pointwise_convs_outside_channel_vectors_keep_pixel_vectors(knob_database, in_channels,
                                                                    out_channels):
    kernel = _scheduled_kernel(pointwise_residual_model(in_channels, out_channels), "conv2d",
                               knob_database)
    assert '"tightfit.channel_vectors": False' in kernel


@pytest.mark.parametrize("mcpu, channel_vectors", [("haswell", True), ("skylake-avx512", False)],
                         ids=["avx2", "avx512"])
def test_pointwise_convs_that_row_tiles_give_one_vector_run_channel_vectors_on_avx2(
        mcpu, channel_vectors):
    """MobileNetV2's 96 -> 576 expansion: weights over ROW_TILES_OUTER_MAX_WEIGHT_BYTES, so
    ROW_TILES would tile it one vector wide. On AVX2, whose multiply-adds cannot read a
    broadcast from memory, it runs CHANNEL_VECTORS instead (conv2d.uses_channel_vectors); on
    AVX-512 it keeps ROW_TILES. A layer that ROW_TILES tiles two vectors wide keeps them on
    both. The AVX2 kernel matches onnxruntime at planes of a pixel, a tile and one, 5x4, 7x7
    and 14x14, on any x86-64 host with AVX2."""
    isa = isa_for_target(tvm.target.Target({"kind": "llvm", "mcpu": mcpu}))
    assert not conv2d.uses_channel_vectors(isa, 192, 32, 1, 192 * 32 * 4)
    in_channels, out_channels = 96, 576
    assert in_channels * out_channels * 4 > register_tile.ROW_TILES_OUTER_MAX_WEIGHT_BYTES
    assert in_channels < conv2d.CHANNEL_VECTORS_MIN_CHANNELS
    target = {"kind": "llvm", "mcpu": mcpu, "num-cores": 2}
    model = pointwise_residual_model(in_channels, out_channels)
    scheduled, _ = run_pipeline(import_onnx(model).mod, resolve_target(target), PipelineOptions(),
                                stop_after="tightfit.FallbackCPUSchedule")
    assert f'"tightfit.channel_vectors": {channel_vectors}' in scheduled.script()
    if not channel_vectors or not tvm.target.codegen.target_has_features(
            "avx2", resolve_target("host").tvm_target):
        return
    session = tightfit.compile(model, target).session()
    _, pixels = conv2d.channel_vector_tile(isa, out_channels)
    for plane in [(1, 1), (1, pixels + 1), (5, 4), (7, 7), (14, 14)]:
        feeds = {"x": _normal(2, in_channels, *plane), "r": _normal(2, out_channels, *plane)}
        np.testing.assert_allclose(session.run(feeds)["y"], run_onnxruntime(model, feeds)["y"],
                                   rtol=1e-4, atol=1e-4, err_msg=f"plane {plane}")


def test_channel_vector_tiles_fit_each_vector_unit():
    """Two 16-channel panels x 7 pixels where AVX-512's registers hold them; NEON's panel is
    four vectors, so one panel x 6 pixels (28 accumulators of 32 registers)."""
    assert conv2d.channel_vector_tile(AVX512, 64) == (2, 7)
    assert conv2d.channel_vector_tile(AVX512, 48) == (1, 7)
    assert conv2d.channel_vector_tile(NEON, 64) == (1, 6)
    assert conv2d.channel_vector_tile(AVX2, 64) == (1, 6)
    for isa in (AVX2, AVX512, NEON):
        panels, pixels = conv2d.channel_vector_tile(isa, 64)
        assert isa.fits_registers(pixels, panels * conv2d.CHANNEL_VECTORS_PANEL // isa.lanes)


@pytest.mark.parametrize("height", [6, 12])
def test_pointwise_conv_over_a_static_height_and_a_symbolic_width(knob_database, height):
    """A text line's maps (OCR: the height fixed, the width dynamic), at heights that do not
    divide a tile's columns, where the write-back's region was not proven covered and the
    compile failed; planes under, at and over a tile and with a shifted tail."""
    lanes = isa_for_target(resolve_target("host").tvm_target).lanes
    widths = sorted({1, 2, -(-2 * lanes // height), -(-2 * lanes // height) + 1, 3 * lanes + 1})
    assert_matches_onnxruntime(conv_model(6, 17, groups=1, kernel=1, height=height),
                               "conv2d_width_vectors", knob_database,
                               lambda w: {"x": _normal(1, 6, height, w)}, widths,
                               conv_algorithms=("width_vectors",))


def test_conv1d_runs_as_a_conv2d_kernel_at_width_bucket_edges(knob_database):
    lanes = isa_for_target(resolve_target("host").tvm_target).lanes
    assert_matches_onnxruntime(conv1d_model(6, 20, stride=2), "conv2d_width_vectors", knob_database,
                               lambda w: {"x": _normal(1, 6, w)},
                               sorted({2 * edge for edge in row_edges(lanes)} | {2 * lanes - 1}))


@pytest.mark.parametrize("tile_rows", [1, conv2d.DEPTHWISE_ROWS])
@pytest.mark.parametrize("stride", [1, 2])
def test_depthwise_conv_versions_match_onnxruntime_at_vector_edges(knob_database, monkeypatch,
                                                                   stride, tile_rows):
    """Tiles of one row and of DEPTHWISE_ROWS rows (depthwise_rows picks by the registers;
    both are forced here, whatever the host): every count of output rows past a whole tile,
    so the last tile is full and 1 to tile_rows - 1 rows out of the map, at each width edge."""
    monkeypatch.setattr(conv2d, "depthwise_rows", lambda isa, kernel_h, kernel_w: tile_rows)
    lanes = isa_for_target(resolve_target("host").tvm_target).lanes
    widths = sorted({stride * (edge - 1) + 1 for edge in row_edges(lanes)} | {stride * lanes})
    heights = [stride * (rows - 1) + 1 for rows in range(tile_rows + 1, 2 * tile_rows + 1)]
    model = conv_model(6, 6, groups=6, stride=stride, height="h")
    # the maps narrower than a tile store each row with one masked vector store
    assert "masked_store" in _scheduled_kernel(model, "depthwise", knob_database, ("depthwise",))
    assert_matches_onnxruntime(model, "conv2d_depthwise", knob_database,
                               lambda hw: {"x": _normal(1, 6, *hw)},
                               [(h, w) for h in heights for w in widths])


def test_depthwise_tiles_are_as_many_rows_as_the_registers_hold():
    """Four rows of a 3x3 tile with the input rows they share need 31 registers: AVX-512 and
    NEON (32) tile four rows, AVX2 and SSE (16) one; a 5x5 tile's 25 taps leave no room for
    shared rows anywhere. The kernel carries its rows for the schedule."""
    assert [conv2d.depthwise_rows(isa, 3, 3) for isa in (AVX512, NEON, AVX2, SSE)] == [4, 4, 1, 1]
    assert conv2d.depthwise_rows(AVX512, 5, 5) == 1
    for mcpu, rows in [("haswell", 1), ("skylake-avx512", 4)]:
        target = {"kind": "llvm", "mcpu": mcpu, "num-cores": 2}
        lowered, _ = run_pipeline(import_onnx(conv_model(6, 6, groups=6)).mod,
                                  resolve_target(target), stop_after="tightfit.SelectConvAlgorithm")
        assert f'"{conv2d.DEPTHWISE_ROWS_ANNOTATION}": {rows}' in lowered.script()


@pytest.mark.parametrize("stride, pads", [(2, [0, 0, 0, 0]), (2, [1, 2, 0, 1]), (1, [2, 0, 1, 3])])
def test_depthwise_packing_rows_match_onnxruntime_at_vector_edges(knob_database, stride, pads):
    """The packing stage's vector loads, deinterleaving shuffles and edge columns
    (padding.py) under paddings of 0 to 3 columns on either side, at widths around two and
    three vectors of input columns, around half a vector's chunk, and one needing every chunk
    width (a vector, a half and a quarter) before its edge columns."""
    lanes = isa_for_target(resolve_target("host").tvm_target).lanes
    half_chunk = stride * lanes // 2
    widths = sorted({3, half_chunk - 1, half_chunk, half_chunk + 1, 2 * lanes - 1, 2 * lanes,
                     2 * lanes + 1, 3 * stride * lanes + 5,
                     stride * (lanes + lanes // 2 + lanes // 4) + 3})
    model = conv_model(6, 6, groups=6, stride=stride, pads=pads)
    kernel = _scheduled_kernel(model, "depthwise", knob_database, ("depthwise",))
    assert "if_then_else" not in kernel  # no check per packed element
    assert ("T.Shuffle" in kernel) == (stride == 2)
    # stores through a view of the row: compacting the packed buffer over each chunk's own
    # offsets made its shape a huge max() that LLVM took seconds over
    assert "T.match_buffer(depthwise_input_phases" in kernel
    assert_matches_onnxruntime(model, "conv2d_depthwise", knob_database,
                               lambda w: {"x": _normal(1, 6, 5, w)}, widths,
                               conv_algorithms=("depthwise",))


def test_depthwise_packing_rows_after_a_strided_conv_over_a_symbolic_height(knob_database):
    """Behind a stride-2 conv the depthwise input's height is (h - 1) // 2 + 1, and compute_at
    leaves its packing rows starting at a min() under a predicate (MobileNetV2's layers): the
    rows are still packed in vectors."""
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                              strides=[2, 2]),
             helper.make_node("Conv", ["c", "w2"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                              strides=[2, 2], group=6)]
    model = _model("strided_chain", nodes,
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, "h", "w"])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, None, None])],
                   [_weight(rng, "w1", (6, 3, 3, 3)), _weight(rng, "w2", (6, 1, 3, 3))])
    assert "if_then_else" not in _scheduled_kernel(model, "depthwise", knob_database)
    lanes = isa_for_target(resolve_target("host").tvm_target).lanes
    assert_matches_onnxruntime(model, "conv2d_depthwise", knob_database,
                               lambda w: {"x": _normal(1, 3, w // 2 + 3, w)},
                               [9, 4 * lanes - 3, 8 * lanes + 6])


@pytest.mark.parametrize("kernel, groups", [("depthwise", 6), ("width_vectors", 1)])
def test_wide_packing_rows_end_in_a_shifted_vector(knob_database, monkeypatch, kernel, groups):
    """In the versions for maps of a tile or wider, a stride-1 image row is packed in whole
    vectors, the last shifted back to end at the row's end, and its two padding columns by two
    stores: no branch per row (the chunks and elements of row_chunks.py). Widths from one vector
    up, with every leftover column count past whole vectors, match. (The packed kernel's own
    versions: otherwise a depthwise conv's unit-stride maps run direct, direct_depthwise.py,
    from 8 rows up in row tiles.)"""
    monkeypatch.setattr(schedule_kernels, "_direct_kernel", lambda *args: None)
    model = conv_model(6, 6, groups=groups, stride=1, pads=[1, 1, 1, 1])
    scheduled = _scheduled_kernel(model, kernel, knob_database, (kernel,))
    lanes = isa_for_target(resolve_target("host").tvm_target).lanes
    wide = [v for v in re.split(r'T\.sblock\("version_\d+"\)', scheduled)[1:]
            if "masked_store" not in v]
    # the row: a variable, or a row block's plus a row's in it (conv2d._pack_in_row_blocks)
    image_rows = [re.search(r"if ([\w +]+?) >= T\.int64\(1\) and \1 < [^\n]*:\n(.*?)\n\s*else:",
                            v, re.DOTALL) for v in wide]
    assert wide and all(image_rows)
    for rows in image_rows:
        assert f"T.Ramp(w - T.int64({lanes}), T.int64(1), {lanes})" in rows.group(2)
        assert not re.search(r"^\s*if ", rows.group(2), re.MULTILINE)
    assert_matches_onnxruntime(model, f"conv2d_{kernel}", knob_database,
                               lambda w: {"x": _normal(1, 6, 5, w)}, range(lanes, 2 * lanes + 2),
                               conv_algorithms=(kernel,))


@pytest.mark.parametrize("stride", [1, 2])
def test_packed_input_is_shared_among_threads_by_rows_as_the_tiles_are(knob_database, stride):
    """The parallel versions pack the padded input by (image, row) (all channels of a row on
    one thread), as the tiles are computed by (image, output row). Maps narrower and wider
    than a tile match."""
    model = conv_model(6, 8, groups=1, stride=stride, height="h")
    kernel = _scheduled_kernel(model, "width_vectors", knob_database, ("width_vectors",))
    assert re.search(r"for n_\w+ in T\.parallel\([^\n]*\n\s*for c, \w+ in T\.grid", kernel)
    assert re.search(r"for n_oh_\w+ in T\.parallel", kernel)
    lanes = isa_for_target(resolve_target("host").tvm_target).lanes
    assert_matches_onnxruntime(model, "conv2d_width_vectors", knob_database,
                               lambda hw: {"x": _normal(1, 6, *hw)},
                               [(9, 5), (2 * lanes + 1, 3 * lanes + 2)],
                               conv_algorithms=("width_vectors",))


@pytest.mark.parametrize("model", ["mobilenet_v2_style", "resnet_style", "grouped_convnet"])
def test_every_conv_kernel_shares_its_threads_by_images_first(model):
    """Each conv kernel's parallel loops (packing, tiles, depthwise channels, im2col, Winograd's
    transforms) begin with the image, so at a batch of at least the thread count every image
    stays on one core from kernel to kernel (conv2d's module docstring). These models cover
    pointwise, 3x3, strided, depthwise, grouped, im2col and Winograd convs."""
    scheduled, _ = run_pipeline(import_onnx(zoo.get(model).build()).mod, resolve_target("host"),
                                stop_after="tightfit.FallbackCPUSchedule")
    parallel_loops = {global_var.name_hint: re.findall(r"for (\w+) in T\.parallel", func.script())
                      for global_var, func in scheduled.functions.items()
                      if re.search("conv2d|winograd|im2col", global_var.name_hint)}
    assert parallel_loops and all(parallel_loops.values())
    for name, loops in parallel_loops.items():
        assert all(loop.startswith("n_") for loop in loops), f"{name}: {loops}"


def test_narrow_depthwise_packing_rows_are_zeroed_whole_in_static_vectors(knob_database):
    """In the version for maps narrower than a tile the packed rows have a static width: each
    is zeroed whole by loops of static trip count before its copies, not from the symbolic end
    of the image row (a chunk loop of symbolic length and `if`s per row); every narrow width
    matches. (Strided depthwise convs read narrow rows directly: test_direct_depthwise.py.)"""
    model = conv_model(6, 6, groups=6, stride=1, pads=[1, 2, 0, 1])
    kernel = _scheduled_kernel(model, "depthwise", knob_database, ("depthwise",))
    versions = re.split(r'T\.sblock\("version_\d+"\)', kernel)[1:]
    narrow = [version for version in versions if "masked_store" in version]
    zero_loop = re.compile(r"for k in range\(([^\n]*)\):\n\s*\S+\[[^\n]*\] = T\.Broadcast\(T\.float32\(0\.0\)")
    assert narrow and all(zero_loop.findall(v) and all(re.fullmatch(r"T\.int64\(\d+\)", extent)
                                                       for extent in zero_loop.findall(v))
                          for v in narrow)
    lanes = isa_for_target(resolve_target("host").tvm_target).lanes
    assert_matches_onnxruntime(model, "conv2d_depthwise", knob_database,
                               lambda w: {"x": _normal(1, 6, 5, w)}, range(1, lanes + 2),
                               conv_algorithms=("depthwise",))


@pytest.mark.parametrize("groups", [6, 1], ids=["depthwise", "width_vectors"])
def test_narrow_rows_are_written_by_masked_vector_stores(knob_database, groups):
    """Maps narrower than a vector: each output row is one masked store of the tile's vector
    (row_chunks.py), not a checked store per column; every width below a vector matches."""
    model = conv_model(6, 6, groups=groups)
    kernel = "depthwise" if groups > 1 else "width_vectors"
    assert "masked_store" in _scheduled_kernel(model, kernel, knob_database)
    lanes = isa_for_target(resolve_target("host").tvm_target).lanes
    assert_matches_onnxruntime(model, f"conv2d_{kernel}", knob_database,
                               lambda w: {"x": _normal(1, 6, 5, w)}, range(1, lanes + 1))


def test_narrow_rows_with_a_residual_input_keep_their_column_check(knob_database):
    """A write-back that adds a residual input along the columns must not read it a whole
    vector wide past the row: it keeps the checked store, and still matches."""
    rng = np.random.default_rng(5)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                              group=6),
             helper.make_node("Add", ["c", "x"], ["y"])]
    model = _model("depthwise_residual", nodes,
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6, 5, "w"])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, 5, "w"])],
                   [_weight(rng, "w", (6, 1, 3, 3))])
    assert "masked_store" not in _scheduled_kernel(model, "depthwise", knob_database)
    assert_matches_onnxruntime(model, "conv2d_depthwise", knob_database,
                               lambda w: {"x": _normal(1, 6, 5, w)}, [1, 3, 7])


@pytest.mark.parametrize("model, kernel", [(dense_model(40), "dense_packed"),
                                           (batched_matmul_model(20), "matmul_packed_rhs"),
                                           (conv_model(4, 24, groups=1), "conv2d_width_vectors"),
                                           (conv_model(6, 6, groups=6), "conv2d_depthwise"),
                                           (conv_model(16, 16, groups=4), "conv2d_width_vectors"),
                                           (pointwise_residual_model(PREFETCH_MIN_CHANNELS, 8),
                                            "conv2d_width_vectors"),
                                           (pointwise_residual_model(
                                               conv2d.CHANNEL_VECTORS_MIN_CHANNELS, 32),
                                            "conv2d_width_vectors")],
                         ids=["dense", "batched_matmul", "conv", "depthwise", "grouped",
                              "pointwise_prefetching", "pointwise_channel_vectors"])
def test_kernels_compile_for_arm64_neon_with_four_lane_vectors(model, kernel):
    package, scheduled = compile_keeping(model, SCHEDULED, target=ARM64)
    assert kernel in kernel_blocks(scheduled)
    assert "T.vectorized(T.int64(4))" in scheduled.script()
    assert "T.vectorized(T.int64(16))" not in scheduled.script()
    assert package.executable is not None


@pytest.mark.parametrize("model, algorithm",
                         [(pointwise_residual_model(128, 128), "width_vectors"),
                          (conv_model(64, 32, groups=1, stride=2), "direct")],
                         ids=["pointwise", "direct"])
def test_weight_prefetches_compile_for_arm64(model, algorithm):
    """A conv whose packed weight is over PREFETCH_MIN_WEIGHT_BYTES with 4-lane panels too
    asks for its weight rows ahead, and LLVM lowers the prefetches for aarch64."""
    package, scheduled = compile_keeping(model, SCHEDULED, target=ARM64,
                                                   options=PipelineOptions(conv_algorithms=(algorithm,)))
    assert re.search(r'"llvm.prefetch", T.address_of\(w_(rows|panels)\[', scheduled.script())
    assert package.executable is not None


@pytest.mark.parametrize("algorithm", ["winograd_f2", "winograd_f4"])
@pytest.mark.parametrize("channels, out_channels, batch", [(4, 17, 1), (16, 32, 1), (12, 24, 2)])
def test_winograd_versions_match_onnxruntime_at_tile_edges(knob_database, algorithm, channels,
                                                           out_channels, batch):
    """Output widths on and around whole Winograd tiles (the last tile partly outside the
    image), the height 5 leaving a partial tile row; transforms vectorized over the channels
    (16 in, 32 out) and not (4 in, 17 out); bias and ReLU fused into the output transform.
    12 -> 24 channels at batch 2: the input gathered in blocks of 8 channels, the last one
    partial (conv2d.gather_channels_in_blocks), the products written back in 8-lane vectors,
    and two images' tiles in V and M, their points inside each tile."""
    tile = WINOGRAD_TILES[algorithm]
    widths = sorted({1, tile - 1, tile, tile + 1, 3 * tile + 2})
    assert_matches_onnxruntime(conv_model(channels, out_channels, groups=1, batch=batch),
                               "winograd", knob_database,
                               lambda w: {"x": _normal(batch, channels, 5, w)},
                               widths, conv_algorithms=(algorithm,))


def test_dense_whose_rows_are_a_symbolic_multiple_of_the_tile_rows(knob_database):
    """x[n, 14, 8] flattened to (n x 14) rows, times 32 columns (7-row tiles here): a row extent
    that TVM's region check could not relate to the tiles' split (tail_tiles.tile_domain)."""
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Reshape", ["x", "rows"], ["flat"]),
             helper.make_node("Gemm", ["flat", "w", "b"], ["y"])]
    model = _model("flattened_dense", nodes,
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 14, 8])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 32])],
                   [numpy_helper.from_array(np.array([-1, 8], np.int64), "rows"),
                    _weight(rng, "w", (8, 32)), _weight(rng, "b", (32,))])
    assert_matches_onnxruntime(model, "dense_packed", knob_database,
                               lambda n: {"x": _normal(n, 14, 8)}, [1, 2, 3])
