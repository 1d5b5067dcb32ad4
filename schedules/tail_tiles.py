"""Tiles over a symbolic extent without predicates: the last tile is shifted back.

A register tile of `tile` rows over an extent M that is only known at run time leaves a partial
last tile. The schedule primitive `split` guards it with a predicate in the innermost loop body,
and that costs twice: the predicate is evaluated per multiply-add, and CompactBufferAllocation can
no longer prove the accumulator tile has `tile` rows, so the accumulators become a dynamically
sized stack array instead of registers (measured 2.5-3.7x slower on a 3x3 conv, TVM 0.27).

Instead, tile t starts at row max(min(t*tile, M - tile), 0): every tile is full, the last one
overlaps its predecessor, and the overlapping rows are computed twice and written twice with the
same values (benign, also across threads). This needs M >= tile, which the caller guarantees by
dispatching smaller extents to a version without row tiles (schedules/dispatch.py), and a domain
of at least `tile` rows, which the kernel computes give their tile buffers (max(M, tile)).

TVM 0.27 has no Python TIR mutator, so `rewrite_loop_nest` rebuilds the statement kinds that an
s_tir schedule produces (For, SeqStmt, IfThenElse, SBlockRealize/SBlock); leaves stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import s_tir, tirx


def tile_domain(extent, tile: int):
    """The tiles' row domain, max(extent, tile). For an extent that is a symbolic multiple of a
    factor of the tile (n x 14 with 7-row tiles, n x 10 with 6), TVM 0.27 simplifies the split
    of `max` into a form its region-cover check cannot relate to the write-back's rows, and the
    schedule fails; there the domain is written as a select, which keeps the split bounds
    checked (not everywhere: a select also hides the tile's offset from buffer compaction)."""
    if isinstance(extent, (int, tirx.IntImm)):
        return max(int(extent), tile)
    analyzer = tvm.sym.Analyzer()
    if any(tile % factor == 0 and analyzer.can_prove(tirx.floormod(extent, factor) == 0)
           for factor in range(2, tile + 1)):
        return tirx.Select(extent >= tile, extent, tirx.const(tile, extent.ty.dtype))
    return tirx.max(extent, tile)


def shifted_tile_start(tile_start, extent, tile: int):
    """Where a tile meant to start at `tile_start` starts: no later than `extent - tile`, so
    the last tile ends at the extent (extent >= tile; the max keeps a tile of a smaller extent,
    dispatched elsewhere, from indexing below zero)."""
    return tirx.max(tirx.min(tile_start, extent - tile), 0)


def shift_tail_tile(func: tirx.PrimFunc, row_iters: dict[str, int], tile: int,
                    extent, keep_checks: frozenset[str] = frozenset()) -> tirx.PrimFunc:
    """Rebind the row iterator of each block in `row_iters` (block name -> iterator index) to
    full tiles, the last one shifted back, and drop the split's bounds checks on it (except in
    the blocks named in `keep_checks`).

    The row binding e of a block is (tile index) * tile + (row in tile), however the tile loop
    was fused afterwards; it becomes max(min(e // tile * tile, extent - tile), 0) + e % tile.
    A predicate conjunct on the row-in-tile loop is the split's bounds check (however the
    simplifier wrote it) and goes.
    """
    analyzer = tvm.sym.Analyzer()

    def rebind(realize: s_tir.SBlockRealize) -> s_tir.SBlockRealize:
        index = row_iters.get(realize.block.name_hint)
        if index is None:
            return realize
        values = list(realize.iter_values)
        row = values[index]
        tile_start = analyzer.simplify(tirx.floordiv(row, tile) * tile)
        row_in_tile = analyzer.simplify(tirx.floormod(row, tile))
        values[index] = shifted_tile_start(tile_start, extent, tile) + row_in_tile
        if realize.block.name_hint in keep_checks:
            return s_tir.SBlockRealize(values, realize.predicate, realize.block)
        inner_vars = tirx.analysis.undefined_vars(row_in_tile)
        kept = [c for c in conjuncts(realize.predicate) if not uses_any(c, inner_vars)]
        return s_tir.SBlockRealize(values, all_of(kept), realize.block)

    def bind_loop(loop: tirx.For) -> None:
        analyzer.bind(loop.loop_var, tvm.ir.Range.from_min_extent(loop.min, loop.extent),
                      allow_override=True)

    return func.with_body(rewrite_loop_nest(func.body, rebind, on_enter_for=bind_loop))


def restrict_loop(func: tirx.PrimFunc, loop_var: tirx.Var, extent) -> tirx.PrimFunc:
    """Run the loop of `loop_var` over [0, extent) only (extent <= its domain, caller's proof)."""

    def cut(loop: tirx.For) -> tirx.For | None:
        if loop.loop_var.same_as(loop_var):
            return tirx.For(loop.loop_var, loop.min, extent, loop.kind, loop.body,
                            loop.thread_binding, loop.annotations)
        return None

    return func.with_body(rewrite_loop_nest(func.body, lambda realize: realize, cut))


def rewrite_loop_nest(stmt, on_realize: Callable, on_for: Callable | None = None,
                      on_enter_for: Callable | None = None):
    """Rebuild `stmt`, passing each block realize (after its body) through `on_realize`.

    `on_for` may replace a loop before its body is visited (None keeps it); `on_enter_for`
    hears of every loop on the way down (to bind loop ranges in an analyzer).
    """
    def visit(node):
        return rewrite_loop_nest(node, on_realize, on_for, on_enter_for)

    if isinstance(stmt, tirx.For):
        replaced = on_for(stmt) if on_for is not None else None
        loop = replaced if replaced is not None else stmt
        if on_enter_for is not None:
            on_enter_for(loop)
        return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, visit(loop.body),
                        loop.thread_binding, loop.annotations)
    if isinstance(stmt, tirx.SeqStmt):
        return tirx.SeqStmt([visit(s) for s in stmt.seq])
    if isinstance(stmt, tirx.IfThenElse):
        else_case = visit(stmt.else_case) if stmt.else_case is not None else None
        return tirx.IfThenElse(stmt.condition, visit(stmt.then_case), else_case)
    if isinstance(stmt, s_tir.SBlockRealize):
        block = stmt.block
        body = visit(block.body)
        init = visit(block.init) if block.init is not None else None
        new_block = s_tir.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, body,
                                 init, block.alloc_buffers, block.match_buffers, block.annotations)
        return on_realize(s_tir.SBlockRealize(stmt.iter_values, stmt.predicate, new_block))
    return stmt



def uses_any(expr, variables) -> bool:
    """Whether `expr` reads any of `variables`."""
    used = tirx.analysis.undefined_vars(expr)
    return any(var.same_as(u) for var in variables for u in used)


def conjuncts(expr) -> list:
    if isinstance(expr, tirx.And):
        return conjuncts(expr.a) + conjuncts(expr.b)
    if isinstance(expr, tirx.IntImm) and expr.value == 1:
        return []
    return [expr]


def all_of(conditions: list):
    result = tirx.const(True, "bool")
    for condition in conditions:
        result = condition if not conjuncts(result) else tirx.And(result, condition)
    return result
