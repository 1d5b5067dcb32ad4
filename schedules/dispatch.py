"""Shape buckets and run-time dispatch between kernel versions inside one PrimFunc.

SoD2 §4.4.2 ("multi-version code for hot operators": fat, regular and skinny matrices) and
MLC-LLM's low-batch GEMV specialization. A kernel whose row extent M is symbolic is scheduled
once per bucket, and the versions are joined by `if` on M at the top of one PrimFunc, so the
Relax graph, fusion and memory planning see a single kernel.

Buckets, on M = the extent the register tile runs along (a GEMM's rows: batch x sequence for a
transformer's linear layers, 1 in a decoder step; a conv's output width; a depthwise conv's
output width in vectors):
- M >= rows: ROW_TILES, tiles of `rows` rows (the last one shifted back); regular and fat
  GEMMs, large spatial convs. A separate fat version (reduction blocked for the cache) is not
  built: it pays only once a B panel (K x NB floats) outgrows L2, and no layer of the models
  at hand comes near (register_tile.py's limit).
- M < rows: SINGLE_ROW, one row at a time across wide vector panels, parallel over the
  panels; skinny GEMMs (GEMV-like) and convs narrower than a tile (7x7 maps and below).
The threshold is the tile height because that is where a row tile stops fitting: the shifted
tail needs M >= rows. A static M compiles only its own version.
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx

from .register_tile import ROW_TILES, SINGLE_ROW


def row_buckets(row_extent, rows: int) -> list[tuple[str, object]]:
    """[(version, run-time condition or None for "otherwise")], most specific first."""
    if isinstance(row_extent, (int, tirx.IntImm)):
        return [(ROW_TILES if int(row_extent) >= rows else SINGLE_ROW, None)]
    return [(ROW_TILES, row_extent >= rows), (SINGLE_ROW, None)]


def join_versions(versions: list[tuple[object, tirx.PrimFunc]]) -> tirx.PrimFunc:
    """One PrimFunc running the first version whose condition holds (the last has None).

    All versions are schedules of the same PrimFunc, so they share its parameters; each keeps
    the intermediate buffers its schedule made. Loops a schedule left alone are the same
    variables in every version; ConvertSSA renames the repeats (TIR defines a variable once).
    """
    if len(versions) == 1:
        return versions[0][1]
    body = None
    allocations = []
    for condition, func in reversed(versions):
        root = func.body.block
        for buffer in root.alloc_buffers:
            if not any(buffer.same_as(known) for known in allocations):
                allocations.append(buffer)
        body = root.body if body is None else tirx.IfThenElse(condition, root.body, body)
    first_root = versions[0][1].body
    root = first_root.block
    joined = s_tir.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint, body, root.init,
                          allocations, root.match_buffers, root.annotations)
    func = versions[0][1].with_body(s_tir.SBlockRealize(first_root.iter_values,
                                                        first_root.predicate, joined))
    return tirx.transform.ConvertSSA()(tvm.IRModule({"main": func}))["main"]
