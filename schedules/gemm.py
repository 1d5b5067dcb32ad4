"""Matrix-multiply kernels as TE computes in the register-tile form (register_tile.py).

- `dense_packed`: A[*batch, M, K] x W[K, N] with W a weight, packed offline
  (PreTransformWeights) into panels [ceil(N / NB), K, NB]; covers ONNX Gemm, MatMul with a
  constant right side, and 1x1-free linear layers of transformers.
- `matmul_packed_rhs`: A[*batch, M, K] x B[*batch, K, N] with both computed at run time
  (attention's Q.K^T and P.V); B is packed into panels by a stage inside the kernel.
The row extent M is the second-last axis of A (a sequence or a batch); the leading axes are
looped over outside the tiles. Tiles' row domain is max(M, rows) (tail_tiles.py).
Limits: fp32; batch axes of the two operands must be equal (no broadcasting) in
`matmul_packed_rhs`.
"""

from __future__ import annotations

from tvm import te, tirx

from .register_tile import (
    KERNEL_ANNOTATION,
    OUTPUT_ROW_AXIS_ANNOTATION,
    REDUCTION_UNROLL_ANNOTATION,
    ROWS_ANNOTATION,
    STAGE_ANNOTATION,
    VECTORS_ANNOTATION,
    WEIGHT_BYTES_ANNOTATION,
    weight_bytes,
)
from .tail_tiles import tile_domain

DENSE = "dense_packed"
MATMUL = "matmul_packed_rhs"
# the stage that packs matmul_packed_rhs's rhs into panels (padding.vector_panel_rows)
RHS_PANELS = "matmul_rhs_panels"


def pack_dense_weight(weight: te.Tensor, panel_width: int) -> te.Tensor:
    """[K, N] -> [ceil(N / NB), K, NB], columns zero-padded to whole panels."""
    reduction, columns = (int(d) for d in weight.shape)
    panels = -(-columns // panel_width)

    def packed(panel, k, lane):
        n = panel * panel_width + lane
        return tirx.if_then_else(n < columns, weight[k, tirx.min(n, columns - 1)],
                                 tirx.const(0, weight.dtype))

    return te.compute((panels, reduction, panel_width), packed, name="dense_weight_panels")


def dense_packed(data: te.Tensor, packed_weight: te.Tensor, out_features: int, rows: int,
                 vectors: int, reduction_unroll: int = 1, points_inside: bool = False) -> te.Tensor:
    """A[*batch, M, K] x packed W: [panels, K, NB] shared by the batch, or [*lead, panels, K,
    NB], a weight per entry of the leading batch axes.

    `points_inside`: A holds the weight's own axes after its rows instead, A[*batch, M, *lead,
    K], and the result does too, [*batch, M, *lead, N]: Winograd's tiles with their transform
    points inside (winograd.py), so that a tile's points are neighbours in memory. The kernel
    loops over (*lead, *batch) either way."""
    *weight_batch, panels, _, panel_width = (int(d) for d in packed_weight.shape)
    lead_count = len(weight_batch)
    if points_inside:
        *batch, row_extent = data.shape[:-1 - lead_count]
        batch = [*weight_batch, *batch]
    else:
        *batch, row_extent, _ = data.shape
    assert lead_count <= len(batch), "a weight per entry of leading batch axes, or one"
    reduction = data.shape[-1]
    k = te.reduce_axis((0, reduction), "k")

    def data_index(b, m):
        if points_inside:
            return (*b[lead_count:], m, *b[:lead_count], k)
        return (*b, m, k)

    def tile_value(*index):
        *b, m, o = index
        weight_index = (*b[:lead_count], o // panel_width, k, o % panel_width)
        return te.sum(data[data_index(b, m)] * packed_weight[weight_index], axis=k)

    # one entry of the leading batch axes' weight: whether it stays in L2 while the row tiles
    # re-read it decides the loop order
    return _tiles_and_out(tile_value, batch, row_extent, panels * panel_width, out_features,
                          DENSE, rows, vectors, reduction_unroll,
                          {WEIGHT_BYTES_ANNOTATION: weight_bytes(packed_weight, 3)},
                          out_axes=_lead_between_rows_and_columns(len(batch), lead_count)
                          if points_inside else None)


def matmul_packed_rhs(lhs: te.Tensor, rhs: te.Tensor, rows: int, vectors: int,
                      lanes: int, reduction_unroll: int = 1,
                      out_axes: tuple[int, ...] | None = None,
                      rhs_transposed: bool = False) -> te.Tensor:
    """`out_axes`: the product's axes in the order the result holds them, the columns last
    (a permute_dims after the product, done by the write-back: attention's head merge
    [b, h, s, d] -> [b, s, h, d]); None keeps them in order. `rhs_transposed`: `rhs` is
    B^T [*batch, N, K] (attention's keys, before the transpose the packing then does)."""
    *batch, row_extent, reduction = lhs.shape
    columns = rhs.shape[-2] if rhs_transposed else rhs.shape[-1]
    panel_width = vectors * lanes
    panels = (columns + panel_width - 1) // panel_width

    def packed(*index):
        *b, panel, r, lane = index
        n = panel * panel_width + lane
        column = tirx.min(n, columns - 1)
        return tirx.if_then_else(n < columns,
                                 rhs[(*b, column, r) if rhs_transposed else (*b, r, column)],
                                 tirx.const(0, rhs.dtype))

    rhs_panels = te.compute((*batch, panels, reduction, panel_width), packed,
                            name=RHS_PANELS, attrs={STAGE_ANNOTATION: "packed_rhs"})
    k = te.reduce_axis((0, reduction), "k")

    def tile_value(*index):
        *b, m, o = index
        return te.sum(lhs[(*b, m, k)] * rhs_panels[(*b, o // panel_width, k, o % panel_width)],
                      axis=k)

    return _tiles_and_out(tile_value, batch, row_extent, panels * panel_width, columns, MATMUL,
                          rows, vectors, reduction_unroll, out_axes=out_axes)


def _lead_between_rows_and_columns(batch_axes: int, lead: int) -> list[int]:
    """The out_axes that move the first `lead` batch axes between the rows and the columns."""
    return [*range(lead, batch_axes), batch_axes, *range(lead), batch_axes + 1]


def _tiles_and_out(tile_value, batch, row_extent, padded_columns, columns, kind: str, rows: int,
                   vectors: int, reduction_unroll: int, annotations: dict | None = None,
                   out_axes: tuple[int, ...] | None = None) -> te.Tensor:
    """The tiles over (*batch, rows, columns), and the result read from them: in the same
    order, or with the axes in the order `out_axes` gives (the columns last)."""
    order = list(out_axes) if out_axes is not None else list(range(len(batch) + 2))
    assert order[-1] == len(batch) + 1 and sorted(order) == list(range(len(batch) + 2))
    tiles = te.compute((*batch, tile_domain(row_extent, rows), padded_columns), tile_value,
                       name=f"{kind}_tiles",
                       attrs={KERNEL_ANNOTATION: kind, ROWS_ANNOTATION: rows,
                              VECTORS_ANNOTATION: vectors,
                              REDUCTION_UNROLL_ANNOTATION: reduction_unroll,
                              OUTPUT_ROW_AXIS_ANNOTATION: order.index(len(batch)),
                              **(annotations or {})})
    extents = [*batch, row_extent, columns]

    def out_value(*index):
        tile_index = [None] * len(order)
        for position, axis in enumerate(order):
            tile_index[axis] = index[position]
        return tiles[tuple(tile_index)]

    return te.compute([extents[axis] for axis in order], out_value, name=f"{kind}_out")
