"""Rows of a symbolic width in vector chunks instead of a check per element.

TVM 0.27 scalarizes a vectorized loop whose body is guarded per element (`if column < width`):
its vectorizer makes such a guard a masked store (buffer-level predication, on in
pipeline.BUILD_CONFIG) only when every access in the loop is a ramp from the guard's base,
which a write-back's loads of its tile and bias are not.

- `chunk_steps` moves a row of symbolic width in chunks: a loop of whole vectors, then at most
  one chunk of each narrower power of two down to MIN_CHUNK_LANES, each under an `if`, then
  the few elements left, each under an `if` (a 14-wide row: an 8-lane chunk, a 4-lane chunk
  and two elements). Loops with a symbolic trip count of 0-3 cost more than their work:
  LLVM's loop vectorizer gives each one a vector body, trip-count checks and a remainder, per
  packed row (a depthwise conv over 1 x 192 x 28 x 28 ran 1.8x slower than the same code with
  static shapes). padding.py packs rows with it.
- `masked_row_write_back` rewrites a kernel's checked write-back rows (maps narrower than a
  vector: MobileNetV2's 14 x 14, 10 x 8 and 7 x 7 maps under 16-lane tiles) into one vector
  store per row: a plain one where the vector lies inside the row, TVM's masked_store of the
  row's valid columns where it does not. Masked stores are slow where the hardware has none
  (NEON: LLVM stores lane by lane) or a slow one (AVX2's vmaskmovps on AMD Zen): attention's
  scores over 2 x 128 tokens, every row stored masked, took 51 us, 25 us with plain stores.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import s_tir, tirx
from tvm.tirx.op import masked_store

from .tail_tiles import all_of, conjuncts, rewrite_loop_nest, uses_any

# The narrowest chunk: AVX-512's quarter vector, NEON's whole one.
MIN_CHUNK_LANES = 4


def chunk_steps(available, lanes: int, index_type: str,
                chunk_body: Callable[[object, int], tirx.Stmt],
                prove: Callable[[object], bool] | None = None) -> tuple[list[tirx.Stmt], object]:
    """Statements running `chunk_body(offset, count)` over [0, available) in chunks: a loop of
    `lanes`-wide ones, then an `if` for each narrower power of two down to MIN_CHUNK_LANES (or
    `lanes`, if narrower); at most one of each fits. Returns them and how many elements they
    cover: fewer than `narrowest_chunk(lanes)` are left (`element_steps` does those).

    Each offset is a closed form of `available` (the chunk of c lanes runs when bit c of it is
    set, after the bits above): offsets accumulated step by step doubled the expression at
    every step, and LLVM took 16 s on one stride-2 depthwise kernel. A step that `prove` (the
    caller's analyzer, which may know the kernel version's bounds) shows never runs is left
    out: the passes lowering a kernel take time in proportion to its `if`s."""
    prove = prove or tvm.sym.Analyzer().can_prove
    total = available if prove(available >= 0) else tvm.sym.Analyzer().simplify(
        tirx.max(available, 0))
    var = tirx.Var("k", index_type)
    steps = [] if prove(total < lanes) else [
        tirx.For(var, tirx.const(0, index_type), tirx.floordiv(total, lanes),
                 tirx.ForKind.SERIAL, chunk_body(var * lanes, lanes))]
    count = lanes // 2
    while count >= narrowest_chunk(lanes):
        start = tirx.floordiv(total, 2 * count) * (2 * count)
        runs = tirx.floormod(total, 2 * count) >= count
        if not prove(tirx.Not(runs)):
            steps.append(tirx.IfThenElse(runs, chunk_body(start, count), None))
        count //= 2
    narrowest = narrowest_chunk(lanes)
    return steps, tirx.floordiv(total, narrowest) * narrowest


def element_steps(begin, end, most: int, body: Callable[[object], tirx.Stmt],
                  prove: Callable[[object], bool] | None = None) -> list[tirx.Stmt]:
    """`body(j)` for each j in [begin, end), which holds at most `most` elements, under an `if`
    each; those `prove` shows past the end are left out (`chunk_steps`)."""
    prove = prove or tvm.sym.Analyzer().can_prove
    return [tirx.IfThenElse(begin + t < end, body(begin + t), None) for t in range(most)
            if not prove(begin + t >= end)]


def narrowest_chunk(lanes: int) -> int:
    return min(MIN_CHUNK_LANES, lanes)


def masked_row_write_back(func: tirx.PrimFunc, block_name: str) -> tirx.PrimFunc:
    """`func` with the write-back block `block_name`, where a vectorized column loop runs it
    under a check on the column (the split's bound: column < the output's width), computing
    the whole vector into a row buffer and storing it whole where it fits in the row, else the
    row's valid columns with one masked store. Left as it is where the block's value reads a
    function parameter along the columns (a residual input): the whole vector would read past
    it."""
    params = [param for param in func.params if hasattr(param, "shape")]

    def masked(columns) -> s_tir.SBlockRealize | None:
        if not (isinstance(columns, tirx.For) and columns.kind == tirx.ForKind.VECTORIZED
                and isinstance(columns.body, s_tir.SBlockRealize)
                and columns.body.block.name_hint == block_name):
            return None
        return _masked_row(columns, params)

    def replace(loop: tirx.For):
        # the column loop is the body of a loop over rows, or, in a tile of one row, one
        # statement of the tile's loop body beside the tile's computation
        body = list(loop.body.seq) if isinstance(loop.body, tirx.SeqStmt) else [loop.body]
        rows = [masked(stmt) for stmt in body]
        if all(row is None for row in rows):
            return None
        body = [stmt if row is None else row for stmt, row in zip(body, rows)]
        return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind,
                        body[0] if len(body) == 1 else tirx.SeqStmt(body),
                        loop.thread_binding, loop.annotations)

    return func.with_body(rewrite_loop_nest(func.body, lambda realize: realize, replace))


def _masked_row(columns: tirx.For, params) -> s_tir.SBlockRealize | None:
    realize = columns.body
    block = realize.block
    lane = columns.loop_var
    row_checks = [c for c in conjuncts(realize.predicate) if not uses_any(c, [lane])]
    if len(row_checks) == len(conjuncts(realize.predicate)) \
            or not isinstance(block.body, tirx.BufferStore):
        return None  # no column check to replace
    bindings = {iv.var: value for iv, value in zip(block.iter_vars, realize.iter_values)}
    reads = [_region_over_lanes(region, bindings, lane, columns.extent) for region in block.reads]
    if any(any(region.source.same_as(param) for param in params)
           and any(not _is_one(dim.extent) for dim in region.region) for region in reads):
        return None  # the whole vector would read a parameter past the row
    store = block.body
    value = substitute(store.value, bindings)
    indices = [substitute(index, bindings) for index in store.indices]
    analyzer = tvm.sym.Analyzer()
    first = substitute(indices[-1], {lane: tirx.const(0, lane.ty.dtype)})
    if not analyzer.can_prove_equal(indices[-1], first + lane):
        return None
    index_type = lane.ty.dtype
    out = store.buffer
    valid = analyzer.simplify(tirx.min(out.shape[-1] - first, columns.extent))

    # "global": a constant-size stack array (isa.py), which LLVM keeps in a register
    row = tirx.decl_buffer((columns.extent,), out.dtype, f"{block.name_hint}_row")
    compute = tirx.For(lane, columns.min, columns.extent, tirx.ForKind.VECTORIZED,
                       tirx.BufferStore(row, value, [lane]))
    count = int(columns.extent)
    lanes = tirx.Ramp(tirx.const(0, index_type), tirx.const(1, index_type), count)
    out_lanes = tirx.Ramp(first, tirx.const(1, index_type), count)
    whole_store = tirx.BufferStore(out, tirx.BufferLoad(row, [lanes]), [*indices[:-1], out_lanes])
    partial_store = tirx.Evaluate(masked_store(
        out, tirx.BufferLoad(row, [lanes]), *indices[:-1], out_lanes,
        lanes < tirx.Broadcast(valid, count)))
    store = tirx.IfThenElse(first + count <= out.shape[-1], whole_store, partial_store)
    body = tirx.SeqStmt([compute, store])
    if row_checks:
        body = tirx.IfThenElse(all_of(row_checks), body, None)
    whole = tvm.ir.Range.from_min_extent
    writes = [tirx.BufferRegion(out, [whole(i, 1) for i in indices[:-1]] + [whole(first, valid)])]
    return s_tir.SBlockRealize([], tirx.const(True, "bool"), s_tir.SBlock(
        [], reads, writes, block.name_hint, body, None, [row]))


def _region_over_lanes(region: tirx.BufferRegion, bindings: dict, lane: tirx.Var, lanes):
    """A block read region with the block's iterators bound, widened to every lane along a
    dimension that moves with the lane."""
    ranges = []
    for dim in region.region:
        start = substitute(dim.min, bindings)
        if uses_any(start, [lane]):
            start = substitute(start, {lane: tirx.const(0, lane.ty.dtype)})
            ranges.append(tvm.ir.Range.from_min_extent(start, lanes))
        else:
            ranges.append(tvm.ir.Range.from_min_extent(start, dim.extent))
    return tirx.BufferRegion(region.source, ranges)


def substitute(expr, bindings: dict):
    """`expr` with each variable of `bindings` replaced by its expression (TVM 0.27 has no
    Python TIR substitute; an analyzer binding substitutes while it simplifies)."""
    analyzer = tvm.sym.Analyzer()
    for var, value in bindings.items():
        analyzer.bind(var, value)
    return analyzer.simplify(expr)


def _is_one(extent) -> bool:
    return isinstance(extent, tirx.IntImm) and extent.value == 1
