"""Zero-padded packing stages in vector loads and stores instead of a check per element.

A packing stage (conv2d.pack_input_phases) computes each element of the padded, phase-split
input as `if inside: input[...] else 0`. TVM 0.27 cannot vectorize that: its vectorizer
scalarizes an if_then_else (the load must not run where the condition fails), a select over a
clamped load becomes a gather (measured 2-3x slower again), and LoopPartition, which would
split the loop at the padding, fails on symbolic extents. A scalar load per element caps the
stage at ~27 GB/s on two cores here: a stride-2 depthwise conv over 2 x 96 x 80 x 64 spent 150
of its 204 us packing (53 us with the input reads taken out).

`vector_packing_rows` rewrites such a stage, once scheduled, per padded row:

    if top <= row < height + top:                          # the row is inside the image
      packed[row, phase, padding columns] = 0
      for each chunk of stride x V input columns:          # stride 1: one vector load;
        packed[row, phase, j:j+V] = input[row - top, ...]  # stride 2: two, deinterleaved
      one chunk of V/2, then V/4, where columns are left   #   by two shuffles
      the columns left at the right edge: one at a time
    else:
      packed[row, :, :] = 0

At stride 1, in a kernel version for rows of at least a vector, the chunks and single columns
give way to one more whole vector, shifted back to end at the row's end (`_shifted_tail_copy`).

The row checks move from every element to every row; no load leaves the image row.

`vector_panel_rows` does the same for matmul_packed_rhs's panels (gemm.py), whose packing
stage is `panel[.., p, k, lane] = if p * W + lane < N: rhs[.., k, p * W + lane] else 0` per
element: a panel row is one vector load from the rhs row where the panel is whole, and in the
last panel of a symbolic N a masked load, zeros past N (attention's Q.K^T at 16 tokens spent
about a third of its time packing K one element at a time).
"""

from __future__ import annotations

import functools

import tvm
from tvm import s_tir, tirx
from tvm.tirx.op import masked_load

from .row_chunks import chunk_steps, element_steps, narrowest_chunk, substitute
from .tail_tiles import all_of, rewrite_loop_nest, uses_any

# On a packing stage built by conv2d.pack_input_phases: [top, left, stride_w]
PADDING_ANNOTATION = "tightfit.padding"


def vector_packing_rows(func: tirx.PrimFunc, block_name: str, lanes: int,
                        version_condition=None) -> tirx.PrimFunc:
    """`func` with the loops (row, phase, column) of packing block `block_name`, which must be
    the block's own innermost loops, replaced by the per-row loops above (`lanes` per
    vector). Stride 1 and 2 (the phases two shuffles split); other strides are left as they
    are. `version_condition`, when given, holds wherever this version of the kernel runs: on a
    map narrower than a tile the packed rows have a static width; on a map a tile wide or wider
    a stride-1 row is copied without branches (`_shifted_tail_copy`)."""

    def replace(loop: tirx.For):
        realize = _row_loop_realize(loop)
        if realize is None or realize.block.name_hint != block_name:
            return None
        if int(realize.block.annotations[PADDING_ANNOTATION][2]) not in (1, 2):
            return None
        row = _packed_row(realize, lanes, version_condition)
        if not (isinstance(realize.predicate, tirx.IntImm) and realize.predicate.value):
            row = tirx.IfThenElse(realize.predicate, row, None)
        return tirx.For(loop.loop_var, loop.min, loop.extent, tirx.ForKind.SERIAL, row)

    return func.with_body(rewrite_loop_nest(func.body, lambda realize: realize, replace))


def vector_panel_rows(func: tirx.PrimFunc, block_name: str) -> tirx.PrimFunc:
    """`func` with the panel packing block `block_name` (gemm.matmul_packed_rhs), whose lane
    loop must be its innermost loop, writing each panel row with one vector load: a plain
    one where the row's lanes are all inside the rhs, a masked one (zeros past its end) where
    they are not. Left as it is where the block is not that gather of one rhs row."""

    def replace(loop: tirx.For):
        lane_loop = loop.body
        if not (isinstance(lane_loop, tirx.For) and isinstance(lane_loop.extent, tirx.IntImm)
                and isinstance(lane_loop.body, s_tir.SBlockRealize)
                and lane_loop.body.block.name_hint == block_name):
            return None
        row = _panel_row(lane_loop)
        if row is None:
            return None
        return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, row,
                        loop.thread_binding, loop.annotations)

    return func.with_body(rewrite_loop_nest(func.body, lambda realize: realize, replace))


def _panel_row(lane_loop: tirx.For) -> s_tir.SBlockRealize | None:
    realize = lane_loop.body
    block = realize.block
    store = block.body
    if not (isinstance(realize.predicate, tirx.IntImm) and realize.predicate.value):
        return None  # a split's bound checked per element: the whole row might not be packed
    if not (isinstance(store, tirx.BufferStore) and isinstance(store.value, tvm.ir.expr.Call)
            and store.value.op.same_as(tvm.ir.Op.get("prim.if_then_else"))):
        return None
    inside, load, _ = store.value.args
    if not (isinstance(inside, tirx.LT) and isinstance(load, tvm.ir.expr.TensorLoad)):
        return None
    lane_vars = [iv.var for iv, value in zip(block.iter_vars, realize.iter_values)
                 if value.same_as(lane_loop.loop_var)]
    if len(lane_vars) != 1:
        return None
    lane = lane_vars[0]
    index_type = lane.ty.dtype
    zero = tirx.const(0, index_type)
    column, columns = inside.a, inside.b
    first_column = substitute(column, {lane: zero})
    first_lane = substitute(store.indices[-1], {lane: zero})
    analyzer = tvm.sym.Analyzer()
    if (not analyzer.can_prove_equal(column, first_column + lane)
            or not analyzer.can_prove_equal(store.indices[-1], first_lane + lane)
            or uses_any(columns, [lane])
            or any(uses_any(index, [lane]) for index in [*load.indices[:-1], *store.indices[:-1]])):
        return None

    bindings = {iv.var: value for iv, value in zip(block.iter_vars, realize.iter_values)
                if not iv.var.same_as(lane)}
    width = int(lane_loop.extent)
    source, panel = load.source, store.buffer
    row = [substitute(index, bindings) for index in load.indices[:-1]]
    panel_row = [substitute(index, bindings) for index in store.indices[:-1]]
    begin, columns = substitute(first_column, bindings), substitute(columns, bindings)
    source_lanes = tirx.Ramp(begin, tirx.const(1, index_type), width)
    panel_lanes = tirx.Ramp(substitute(first_lane, bindings), tirx.const(1, index_type), width)
    lanes = tirx.Ramp(zero, tirx.const(1, index_type), width)
    valid = lanes < tirx.Broadcast(columns - begin, width)
    vector_type = f"{source.dtype}x{width}"
    partial = tirx.Select(valid, masked_load(vector_type, source, *row, source_lanes, valid),
                          tirx.Broadcast(tirx.const(0, source.dtype), width))
    body = tirx.IfThenElse(
        begin + width <= columns,
        tirx.BufferStore(panel, tirx.BufferLoad(source, [*row, source_lanes]),
                         [*panel_row, panel_lanes]),
        tirx.BufferStore(panel, partial, [*panel_row, panel_lanes]))
    whole = tvm.ir.Range.from_min_extent
    reads = [tirx.BufferRegion(source, [whole(index, 1) for index in row]
                               + [whole(0, source.shape[-1])])]
    writes = [tirx.BufferRegion(panel, [whole(index, 1) for index in panel_row]
                                + [whole(panel_lanes.base, width)])]
    return s_tir.SBlockRealize([], tirx.const(True, "bool"), s_tir.SBlock(
        [], reads, writes, block.name_hint, body))


def _row_loop_realize(loop: tirx.For) -> s_tir.SBlockRealize | None:
    """The block realize of the perfect loop nest `loop` opens, when `loop` is its row loop:
    the packed row is `loop`'s variable plus an offset, and the block's predicate depends on
    no inner loop (compute_at under a symbolic height leaves the row range's start as a min
    and a predicate it cannot prove true). A stride-1 stage has no phase loop left: its
    extent was 1."""
    inner_vars = []
    inner = loop.body
    while isinstance(inner, tirx.For):
        inner_vars.append(inner.loop_var)
        inner = inner.body
    if not isinstance(inner, s_tir.SBlockRealize) or len(inner.iter_values) != 5:
        return None
    offset = tvm.sym.Analyzer().simplify(inner.iter_values[2] - loop.loop_var)
    if uses_any(offset, [loop.loop_var, *inner_vars]) or uses_any(inner.predicate, inner_vars):
        return None
    return inner


def _packed_row(realize: s_tir.SBlockRealize, lanes: int, version_condition):
    block = realize.block
    top, left, stride = (int(v) for v in block.annotations[PADDING_ANNOTATION])
    n, c = realize.iter_values[:2]
    packed = block.body.buffer
    data = block.body.value.args[1].source
    height, width = data.shape[2], data.shape[3]
    analyzer = tvm.sym.Analyzer()

    # what holds wherever this version runs: its condition, and image sizes are not negative
    known = all_of([*([] if version_condition is None else [version_condition]),
                    *(extent >= 0 for extent in (height, width)
                      if not isinstance(extent, tirx.IntImm))])

    def in_version(query, expr):
        """`query` (the analyzer's simplify or can_prove) where this version runs."""
        with analyzer.constraint_scope(known):
            return query(expr)

    def provable(condition) -> bool:
        """Proved where this version runs, or else for each residue r of the width modulo the
        stride (width = stride * q + r): the phases' floordivs by the stride become sums the
        analyzer can bound (from a narrow version's (w - 1) // 2 + 1 < 16 it does not prove
        (w + 2) // 2 <= 17, with w = 2q + r it does)."""
        if in_version(analyzer.can_prove, condition):
            return True
        if stride == 1 or not isinstance(width, tirx.Var):
            return False
        quotient = tirx.Var("quotient", width.ty.dtype)
        for residue in range(stride):
            case = {width: quotient * stride + residue}
            with analyzer.constraint_scope(tirx.And(substitute(known, case), quotient >= 0)):
                if not analyzer.can_prove(substitute(condition, case)):
                    return False
        return True

    phase_w = in_version(analyzer.simplify, packed.shape[4])
    row = realize.iter_values[2]
    index_type = row.ty.dtype

    def input_at(column, count=1):
        index = column if count == 1 else tirx.Ramp(column, 1, count)
        return tirx.BufferLoad(data, [n, c, row - top, index])

    # The stores go to a view of the packed row, so that buffer compaction sees the view's
    # declared region, not the union of the chunks' offsets: that union was a max() of dozens
    # of terms, inlined into every index (LLVM took 16 s on one stride-2 depthwise kernel).
    whole = tvm.ir.Range.from_min_extent
    row_region = tirx.BufferRegion(packed, [whole(n, 1), whole(c, 1), whole(row, 1),
                                            whole(0, stride), whole(0, phase_w)])
    row_view = tirx.decl_buffer(
        (stride, phase_w), packed.dtype, f"{packed.name}_row",
        strides=[tirx.Var("phase_stride", index_type), tirx.const(1, index_type)],
        elem_offset=tirx.Var("row_offset", index_type))

    def store(phase, j, value, count=1):
        index = j if count == 1 else tirx.Ramp(j, 1, count)
        return tirx.BufferStore(row_view, value, [phase, index])

    # column j of phase p holds input column j * stride + p - left, inside for j in
    # [first[p], end[p])
    first = [-(-max(left - phase, 0) // stride) for phase in range(stride)]
    end = [_least([tirx.floordiv(width + left - phase + stride - 1, stride), phase_w], provable)
           for phase in range(stride)]
    # A chunk of stride x V input columns from an input column `source` gives each phase V
    # consecutive columns: phase p takes the chunk's elements at offset[p] + stride * t, the
    # input columns from the row's start being phase p's from first[p] on (so all phases
    # start together and the chunk's loads stay inside the row whenever the phases do).
    # row_chunks.chunk_steps sizes the chunks: a 16-wide map at stride 2 fills its phases with
    # two 8-lane chunks, a 10 x 8 map a row per 8-lane chunk.
    offset = [(phase - left) % stride for phase in range(stride)]

    def chunk_copy(done, count):
        source = done * stride
        if stride == 1:
            return store(0, first[0] + done, input_at(source, count), count)
        both = [input_at(source, count), input_at(source + count, count)]
        return tirx.SeqStmt([
            store(phase, first[phase] + done,
                  tirx.Shuffle(both, [offset[phase] + stride * t for t in range(count)]), count)
            for phase in range(stride)])

    def zeros(phase, begin, end_, most_left):
        """Zeros over [begin, end_) of a phase: vector chunks, then single elements."""
        def chunk(j, count=1):
            value = tirx.const(0, packed.dtype)
            return store(phase, begin + j, value if count == 1 else tirx.Broadcast(value, count),
                         count)

        chunks, zeroed = chunk_steps(end_ - begin, lanes, index_type, chunk, provable)
        return chunks + element_steps(zeroed, end_ - begin, most_left, chunk, provable)

    def whole_row_zeros():
        return [stmt for phase in range(stride)
                for stmt in zeros(phase, 0, phase_w, narrowest_chunk(lanes) - 1)]

    columns = in_version(analyzer.simplify, end[0] - first[0])
    right_zeros = in_version(analyzer.simplify, phase_w - end[0])
    if (stride == 1 and not isinstance(phase_w, tirx.IntImm)
            and isinstance(right_zeros, tirx.IntImm)
            and in_version(analyzer.can_prove, columns >= lanes)):
        # a map of a tile or wider (the ROW_TILES version): no branch per row
        padding = [*range(first[0]), *(first[0] + columns + t for t in range(right_zeros.value))]
        inside = ([store(0, j, tirx.const(0, packed.dtype)) for j in padding]
                  + _shifted_tail_copy(input_at, store, columns, first[0], lanes, index_type))
        return _row_block(realize, data, row_view, row_region, inside, whole_row_zeros())

    inside_every_phase = _least([end[p] - first[p] for p in range(stride)], provable)
    copies, copied = chunk_steps(inside_every_phase, lanes, index_type, chunk_copy, provable)
    # a phase holds at most one more column than the one with fewest
    most_left = narrowest_chunk(lanes) if stride > 1 else narrowest_chunk(lanes) - 1
    for phase in range(stride):
        def copy(j, phase=phase):
            return store(phase, j, input_at(j * stride + phase - left))
        copies += element_steps(first[phase] + copied, end[phase], most_left, copy, provable)

    if isinstance(phase_w, tirx.IntImm):
        # A row of static width (a map narrower than a tile) is zeroed whole, in stores whose
        # offsets and count are static, and the copies then overwrite its inside: zeroing from
        # the symbolic end of the image row takes a chunk loop and `if`s per row (a third of a
        # stride-2 depthwise conv over 1 x 576 x 14 x 14).
        edges = whole_row_zeros()
    else:
        # A row inside the image zeroes only its padding columns: LLVM turns a loop of zero
        # stores into a memset call, once per packed row (1.8x slower depthwise convs on
        # 28 x 28 maps).
        edges = []
        for phase in range(stride):
            edges += [store(phase, j, tirx.const(0, packed.dtype)) for j in range(first[phase])]
            edges += zeros(phase, end[phase], phase_w, narrowest_chunk(lanes) - 1)
    return _row_block(realize, data, row_view, row_region, edges + copies, whole_row_zeros())


def _least(values: list, provable):
    """The least of `values`: the one `provable` shows no greater than the others, else their
    min. A min left standing (of the image's end in a phase and the phase's width) is inlined
    into every index of the packed row, and each of TVM's lowering passes simplifies it again
    at each index (MobileNetV2's stem conv kernel: 499 mins before, 51 after, those of its
    tiles and epilogue)."""
    for candidate in values:
        if all(provable(candidate <= other) for other in values if other is not candidate):
            return candidate
    return functools.reduce(tirx.min, values)


def _shifted_tail_copy(input_at, store, columns, first, lanes: int,
                       index_type: str) -> list[tirx.Stmt]:
    """A stride-1 image row of at least a vector copied in whole vectors, the last one shifted
    back to end at the row's end (it rewrites some columns the loop wrote, with the same
    values), like the kernels' tail tiles (tail_tiles.py). The chunked copy spends a branch on
    each narrower chunk and each leftover element, and zeroes the right padding in chunks too,
    in every row: packing took a third of a depthwise conv over 2 x 64 x 48 x 40 (perf), and
    this copy runs such layers 5-14% faster (48 x 40, 28 x 28, 33 x 47 maps)."""
    k = tirx.Var("k", index_type)
    whole_vectors = tirx.floordiv(columns, lanes)
    copy = tirx.For(k, tirx.const(0, index_type), whole_vectors, tirx.ForKind.SERIAL,
                    store(0, first + k * lanes, input_at(k * lanes, lanes), lanes))
    last = columns - lanes
    return [copy, store(0, first + last, input_at(last, lanes), lanes)]


def _row_block(realize, data, row_view, row_region, inside_stmts, outside_stmts):
    """The packed row's block: `inside_stmts` for a row of the image, `outside_stmts` (zeros)
    for a padding row."""
    block = realize.block
    top = int(block.annotations[PADDING_ANNOTATION][0])
    n, c, row = realize.iter_values[:3]
    height, width = data.shape[2], data.shape[3]
    whole = tvm.ir.Range.from_min_extent
    inside = tirx.And(row >= top, row < height + top)
    # stmt_seq: a narrow row whose chunk steps were left out (row_chunks.chunk_steps) may be one
    # statement, which a SeqStmt may not hold
    body = tirx.IfThenElse(inside, tirx.stmt_seq(*inside_stmts), tirx.stmt_seq(*outside_stmts))
    reads = [tirx.BufferRegion(data, [whole(n, 1), whole(c, 1), whole(0, height), whole(0, width)])]
    return s_tir.SBlockRealize([], tirx.const(True, "bool"), s_tir.SBlock(
        [], reads, [row_region], block.name_hint, body,
        match_buffers=[s_tir.MatchBufferRegion(row_view, row_region)]))
