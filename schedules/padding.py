"""Zero-padded packing stages in vector loads and stores instead of a check per element.

A packing stage (conv2d.pack_input_phases) computes each element of the padded, phase-split
input as `if inside: input[...] else 0`. TVM 0.27 cannot vectorize that: its vectorizer
scalarizes an if_then_else (the load must not run where the condition fails), a select over a
clamped load becomes a gather (measured 2-3x slower again), and LoopPartition, which would
split the loop at the padding, fails on symbolic extents. A scalar load per element caps the
stage at ~27 GB/s on two cores here: a stride-2 depthwise conv over 2 x 96 x 80 x 64 spent 150
of its 204 us packing (53 us with the input reads taken out).

`vector_packing_rows` rewrites such a stage, once scheduled, per padded row:

    packed[row, :, :] = 0                                  # vector stores
    if top <= row < height + top:                          # the row is inside the image
      for each vector of columns j inside every phase:     # stride 1: one vector load;
        packed[row, phase, j:j+V] = input[row - top, ...]  # stride 2: two, deinterleaved
      the columns left over at either edge: one at a time  #   by two shuffles

The row checks move from every element to every row; no load leaves the image row.
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx

from .tail_tiles import rewrite_loop_nest

# On a packing stage built by conv2d.pack_input_phases: [top, left, stride_w]
PADDING_ANNOTATION = "tightfit.padding"


def vector_packing_rows(func: tirx.PrimFunc, block_name: str, lanes: int) -> tirx.PrimFunc:
    """`func` with the loops (row, phase, column) of packing block `block_name`, which must be
    the block's own innermost loops, replaced by the per-row loops above (`lanes` per vector).
    Stride 1 and 2 (the phases two shuffles split); other strides are left as they are."""

    def replace(loop: tirx.For):
        realize = _row_loop_realize(loop)
        if realize is None or realize.block.name_hint != block_name:
            return None
        if int(realize.block.annotations[PADDING_ANNOTATION][2]) not in (1, 2):
            return None
        return tirx.For(loop.loop_var, loop.min, loop.extent, tirx.ForKind.SERIAL,
                        _packed_row(realize, loop.loop_var, lanes))

    return func.with_body(rewrite_loop_nest(func.body, lambda realize: realize, replace))


def _row_loop_realize(loop: tirx.For) -> s_tir.SBlockRealize | None:
    """The block realize of the perfect loop nest `loop` opens, when `loop` is its row loop (a
    stride-1 stage has no phase loop left: its extent was 1)."""
    inner = loop.body
    while isinstance(inner, tirx.For):
        inner = inner.body
    if isinstance(inner, s_tir.SBlockRealize) and len(inner.iter_values) == 5 \
            and inner.iter_values[2].same_as(loop.loop_var):
        return inner
    return None


def _packed_row(realize: s_tir.SBlockRealize, row: tirx.Var, lanes: int):
    block = realize.block
    top, left, stride = (int(v) for v in block.annotations[PADDING_ANNOTATION])
    n, c = realize.iter_values[:2]
    packed = block.body.buffer
    data = block.body.value.args[1].source
    height, width = data.shape[2], data.shape[3]
    phase_w = packed.shape[4]
    index_type = row.ty.dtype
    analyzer = tvm.sym.Analyzer()

    def loop(name, begin, end, body_of):
        var = tirx.Var(name, index_type)
        extent = analyzer.simplify(tirx.max(end - begin, 0))
        return tirx.For(var, tirx.const(0, index_type), extent, tirx.ForKind.SERIAL,
                        body_of(var + begin))

    def input_at(column, count=1):
        index = column if count == 1 else tirx.Ramp(column, 1, count)
        return tirx.BufferLoad(data, [n, c, row - top, index])

    def store(phase, j, value, count=1):
        index = j if count == 1 else tirx.Ramp(j, 1, count)
        return tirx.BufferStore(packed, value, [n, c, row, phase, index])

    # column j of phase p holds input column j * stride + p - left, inside for j in
    # [first[p], end[p]); every phase is inside on [interior_first, interior_end)
    first = [-(-max(left - phase, 0) // stride) for phase in range(stride)]
    end = [tirx.min(tirx.floordiv(width + left - phase + stride - 1, stride), phase_w)
           for phase in range(stride)]
    interior_first, interior_end = max(first), end[stride - 1]
    vectors = analyzer.simplify(tirx.floordiv(tirx.max(interior_end - interior_first, 0), lanes))
    vector_end = interior_first + vectors * lanes

    def vector_copy(j):
        source = j * stride - left
        if stride == 1:
            return store(0, j, input_at(source, lanes), lanes)
        both = [input_at(source, lanes), input_at(source + lanes, lanes)]
        return tirx.SeqStmt([
            store(phase, j, tirx.Shuffle(both, [2 * i + phase for i in range(lanes)]), lanes)
            for phase in range(stride)])

    zeros = tirx.Broadcast(tirx.const(0, packed.dtype), lanes)
    zero = tirx.const(0, packed.dtype)
    fill_vectors = phase_w // lanes
    fill = loop("phase", 0, stride, lambda phase: tirx.SeqStmt([
        loop("j", 0, fill_vectors, lambda j: store(phase, j * lanes, zeros, lanes)),
        loop("j", fill_vectors * lanes, phase_w, lambda j: store(phase, j, zero))]))
    copies = [loop("j", 0, vectors, lambda j: vector_copy(interior_first + j * lanes))]
    for phase in range(stride):
        def copy(j, phase=phase):
            return store(phase, j, input_at(j * stride + phase - left))
        copies.append(loop("j", first[phase], tirx.min(interior_first, end[phase]), copy))
        copies.append(loop("j", tirx.max(vector_end, interior_first), end[phase], copy))
    inside = tirx.And(row >= top, row < height + top)
    body = tirx.SeqStmt([fill, tirx.IfThenElse(inside, tirx.SeqStmt(copies), None)])
    whole = tvm.ir.Range.from_min_extent
    reads = [tirx.BufferRegion(data, [whole(n, 1), whole(c, 1), whole(0, height), whole(0, width)])]
    writes = [tirx.BufferRegion(packed, [whole(n, 1), whole(c, 1), whole(row, 1),
                                         whole(0, stride), whole(0, phase_w)])]
    return s_tir.SBlockRealize([], tirx.const(True, "bool"),
                               s_tir.SBlock([], reads, writes, block.name_hint, body))
