"""Attention's scores, softmax and weighted sum in one kernel, the queries across the vector
lanes (issue 5: the hot ops of transformers; SoD2 §4.2: fusion over symbolic shapes, here the
sequence length that the scores' rows, their softmax and the weighted sum share).

softmax(Q K^T x scale) V as three kernels writes the scores [*batch, queries, keys], reads them
back for the softmax, writes the probabilities and reads them again; the softmax folds every
row's maximum and sum across the lanes of a vector; and each kernel is a call of its own. This
kernel takes a tile of `lanes` queries of one batch entry (a head) at a time, each query in a
lane of its own:
- the tile's queries, element by element, gathered into vectors (rows of Q^T) that stay in
  registers;
- for each key: the key's score against every query of the tile, a multiply-add per element of
  the key, broadcast, into that element's vector; scaled; the mask added (a number broadcast
  where all queries share its row, else the tile's queries' elements); kept in a scratch row
  of `keys` vectors, and the maximum so far taken lane by lane;
- for each key: exp(score - maximum) in place, summed lane by lane;
- the weighted sum of V's rows, a chunk of its columns at a time in registers
  (`value_chunks`), a multiply-add of
  each value, broadcast, into the vector of the tile's probabilities of its key; multiplied by
  the reciprocal of the sums and stored, each lane to its query's row.
Maxima and sums run along the keys, so no fold across lanes; K and V are read an element at a
time and neither is packed, so each operand can be read where it lies in the tensor it is a
layout of (`OperandLayout`: K as it is for K^T, the heads of a QKV projection in the
projection, at a stride of three heads' widths per row), and a whole tile's queries are loaded
as rows of `depth` elements where they are not next to each other. The queries of a tile's
lanes past the last query repeat it and are not stored. Tiles (batch entries x query tiles) run
in parallel above the parallel threshold (dispatch.parallel_buckets). The exponential is
row_kernels.fast_exp.

`attention` is the same computation as TE computes (TOPI's softmax between two reductions), the
kernel's definition: FuseAttention emits it, ScheduleKernels replaces its body with this
kernel, and a tuner (`tightfit tune`) sees it as one workload.
Limits: fp32; static head widths (Q's and V's last axes); FuseAttention uses it for narrow
heads only (fuse_attention.MAX_HEAD_WIDTH), where it beats the GEMM kernels.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

from tvm import te, tirx, topi

from .dispatch import MAC_WORK_DIVISOR, nested_ifs, parallel_buckets
from .isa import FP32_BYTES, MAX_STACK_ALLOCA_BYTES, VectorISA
from .row_kernels import fast_exp

# The PrimFunc attribute that marks the kernel: {"layouts": [[offset, shape, strides]] of Q, K,
# V and the mask where there is one, "scale": the op of each scale factor, "out_axes"}
ATTENTION_ATTR = "tightfit.attention"
MULTIPLY = "multiply"
DIVIDE = "divide"


@dataclass(frozen=True)
class OperandLayout:
    """Where element [*batch, row, column] of an operand lies in the tensor the kernel is given
    for it: offset + sum(index x stride) (passes/strided_views.py). Q's rows are its queries,
    K's its keys (K, not K^T), V's its keys; each expression is a constant or the kernel's."""

    offset: tirx.PrimExpr
    shape: tuple[tirx.PrimExpr, ...]
    strides: tuple[tirx.PrimExpr, ...]

    def element(self, index) -> tirx.PrimExpr:
        return self.offset + functools.reduce(
            operator.add, [i * stride for i, stride in zip(index, self.strides)])


def attention(q: te.Tensor, k: te.Tensor, v: te.Tensor, *rest: te.Tensor,
              layouts: tuple[OperandLayout, ...], scale_ops: list[str],
              out_axes: tuple[int, ...] | None) -> te.Tensor:
    """softmax(Q K^T (x or / scale) (+ mask)) V over the last axis, each operand read from the
    tensor given for it as its layout says (Q [*batch, queries, depth], K [*batch, keys, depth],
    V [*batch, keys, values], and a fourth layout where a mask [*batch, queries, keys] follows
    V, its broadcast axes at stride 0). The scores are multiplied or divided (`scale_ops`) by
    each of the `scales` after it, tensors of one element, in turn (a Q and a K scaled each,
    as nn.MultiheadAttention's export does, scale the scores by both), then the mask is added.
    `out_axes`: the result's axes in the order it holds them, the columns last (None: in
    order)."""
    mask, scales = (rest[0], rest[1:]) if len(layouts) == 4 else (None, rest)
    q, k, v = (_operand(source, layout, name)
               for source, layout, name in zip((q, k, v), layouts, "qkv"))
    *batch, queries, depth = q.shape
    keys = k.shape[-2]
    values = v.shape[-1]
    element = te.reduce_axis((0, depth), "element")

    def score(*index):
        *b, query, key = index
        return te.sum(q[(*b, query, element)] * k[(*b, key, element)], axis=element)

    scores = te.compute((*batch, queries, keys), score, name="attention_scores")
    for scale, op in zip(scales, scale_ops):
        scores = _scaled(scores, scale, op)
    if mask is not None:
        mask = _operand(mask, layouts[3], "mask")
        scores = te.compute(scores.shape, lambda *index: scores(*index) + mask(*index),
                            name="attention_masked")
    probabilities = topi.nn.softmax(scores, axis=-1)
    key = te.reduce_axis((0, keys), "key")
    order = list(out_axes) if out_axes is not None else list(range(len(batch) + 2))
    extents = [*batch, queries, values]

    def weighted_sum(*out_index):
        index = [None] * len(order)
        for position, axis in enumerate(order):
            index[axis] = out_index[position]
        *b, query, column = index
        return te.sum(probabilities[(*b, query, key)] * v[(*b, key, column)], axis=key)

    return te.compute([extents[axis] for axis in order], weighted_sum, name="attention_out")


def _scaled(scores: te.Tensor, scale: te.Tensor, op: str) -> te.Tensor:
    first = [0] * len(scale.shape)  # its one element
    if op == MULTIPLY:
        return te.compute(scores.shape, lambda *index: scores(*index) * scale(*first),
                          name="attention_scaled")
    return te.compute(scores.shape, lambda *index: scores(*index) / scale(*first),
                      name="attention_scaled")


def _operand(source: te.Tensor, layout: OperandLayout, name: str) -> te.Tensor:
    return te.compute(layout.shape,
                      lambda *index: source(*_unravel(layout.element(index), source.shape)),
                      name=f"attention_{name}")


def _unravel(flat, shape) -> list:
    """The index of element `flat` of a contiguous tensor of `shape`."""
    index = []
    for dim in reversed(shape):
        index.append(tirx.floormod(flat, dim))
        flat = tirx.floordiv(flat, dim)
    return index[::-1]


def schedule_attention(func: tirx.PrimFunc, isa: VectorISA,
                       min_parallel_work: int) -> tirx.PrimFunc | None:
    """The attention kernel in place of the body of a PrimFunc FuseAttention marked, else None."""
    options = (func.attrs or {}).get(ATTENTION_ATTR)
    if options is None:
        return None
    scale_ops = [str(op) for op in options["scale"]]
    layouts = [OperandLayout(offset, tuple(shape), tuple(strides))
               for offset, shape, strides in options["layouts"]]
    operands = func.params[:len(layouts)]
    scales = func.params[len(layouts):len(layouts) + len(scale_ops)]
    out = func.params[-1]  # after the layouts' scalars
    kernel = _Attention(*operands, *scales, out, layouts=layouts, scale_ops=scale_ops,
                        out_axes=[int(axis) for axis in options["out_axes"]], lanes=isa.lanes)
    versions = [(condition, kernel.loop(parallel))
                for parallel, condition in parallel_buckets(kernel.work(), min_parallel_work)]
    return func.with_body(nested_ifs(versions)).with_attr("tirx.is_scheduled", True)


def value_chunks(values: int, lanes: int) -> list[tuple[int, int]]:
    """(first column, width) of the chunks of V's columns whose sums stay in registers together:
    as few as fit a stack array (isa.py's MAX_STACK_ALLOCA_BYTES: larger, it is a heap buffer
    that LLVM stores back after every multiply-add), of even widths."""
    widest = (MAX_STACK_ALLOCA_BYTES - 1) // (lanes * FP32_BYTES)
    count = -(-values // widest)
    width = -(-values // count)
    return [(start, min(width, values - start)) for start in range(0, values, width)]


class _Attention:
    """The kernel's loop over tiles, for one version (serial or parallel)."""

    def __init__(self, *buffers: tirx.Buffer, layouts: list[OperandLayout],
                 scale_ops: list[str], out_axes: list[int], lanes: int):
        """`buffers`: Q, K, V, the mask where `layouts` has a fourth, each scale, the output."""
        operands, scales, out = buffers[:len(layouts)], buffers[len(layouts):-1], buffers[-1]
        self.scales = list(zip(scales, scale_ops))
        self.q_layout, self.k_layout, self.v_layout, *mask_layout = layouts
        self.mask_layout = mask_layout[0] if mask_layout else None
        *batch, self.queries, depth = self.q_layout.shape
        self.keys = self.k_layout.shape[-2]
        self.depth, self.values = int(depth), int(self.v_layout.shape[-1])
        self.lanes = lanes
        self.index_type = "int64"
        self.batch = batch
        self.entries = functools.reduce(operator.mul, batch, tirx.const(1, self.index_type))
        self.tiles = tirx.floordiv(self.queries + lanes - 1, lanes)
        self.sources = (*operands, out)
        self.views = [tirx.decl_buffer((_size(buffer),), buffer.dtype, f"{buffer.name}_flat",
                                       data=buffer.data) for buffer in self.sources]
        self.q, self.k, self.v, *mask, self.out = self.views
        self.mask = mask[0] if mask else None
        order = out_axes or list(range(len(batch) + 2))
        out_shape = [[*batch, self.queries, self.values][axis] for axis in order]
        strides = [functools.reduce(operator.mul, out_shape[position + 1:],
                                    tirx.const(1, self.index_type))
                   for position in range(len(order))]
        # each axis of [*batch, queries, values]'s stride in the output
        self.out_strides = [strides[order.index(axis)] for axis in range(len(order))]

    def work(self):
        """What a second thread saves (dispatch.loop_work's units): the multiply-adds of the
        scores and the weighted sums, and an elementwise step per score."""
        scores = self.entries * self.queries * self.keys
        return scores * (self.depth + self.values) // MAC_WORK_DIVISOR + scores

    def loop(self, parallel: bool) -> tirx.Stmt:
        task = tirx.Var("tile", self.index_type)
        kind = tirx.ForKind.PARALLEL if parallel else tirx.ForKind.SERIAL
        views = [tirx.DeclBuffer(view, data=source.data)
                 for view, source in zip(self.views, self.sources)]
        return tirx.stmt_seq(*views, tirx.For(task, self._int(0), self.entries * self.tiles, kind,
                                              self._tile(task)))

    def _tile(self, task) -> tirx.Stmt:
        lanes, dtype = self.lanes, "float32"
        entry = tirx.Var("entry", self.index_type)
        first = tirx.Var("first_query", self.index_type)
        scores = tirx.decl_buffer((self.keys * lanes,), dtype, "tile_scores", scope="global")
        peak = tirx.decl_buffer((lanes,), dtype, "tile_peak", scope="global")
        total = tirx.decl_buffer((lanes,), dtype, "tile_total", scope="global")
        maximum = tirx.Var("tile_maximum", f"{dtype}x{lanes}")
        reciprocal = tirx.Var("tile_reciprocal", f"{dtype}x{lanes}")
        key = tirx.Var("key", self.index_type)
        vector = tirx.Ramp(self._int(0), self._int(1), lanes)
        at_key = tirx.Ramp(key * lanes, self._int(1), lanes)

        # the tile's batch index, and where its entry starts in each operand and the output
        batch_index = [tirx.Var(f"batch{axis}", self.index_type)
                       for axis in range(len(self.batch))]
        q_base, k_base, v_base, mask_base, out_base = (
            tirx.Var(f"{name}_base", self.index_type) for name in ("q", "k", "v", "mask", "out"))
        starts = [(q_base, self.q_layout.offset, self.q_layout.strides),
                  (k_base, self.k_layout.offset, self.k_layout.strides),
                  (v_base, self.v_layout.offset, self.v_layout.strides),
                  (out_base, self._int(0), self.out_strides)]
        if self.mask is not None:
            starts.append((mask_base, self.mask_layout.offset, self.mask_layout.strides))
        bases = [*[tirx.Bind(var, index)
                   for var, index in zip(batch_index, self._batch_index(entry))],
                 *[tirx.Bind(base, offset + sum((index * stride for index, stride
                                                 in zip(batch_index, strides)), self._int(0)))
                   for base, offset, strides in starts]]
        # the tile's queries as lanes, a row of Q^T per element: a whole tile's rows loaded as
        # vectors and transposed in registers; a partial tile's gathered, the lanes past the
        # last query repeating it
        query_tile = tirx.decl_buffer((self.depth * lanes,), dtype, "tile_queries",
                                      scope="global")
        row_stride, element_stride = self.q_layout.strides[-2:]
        clamped = tirx.min(tirx.Ramp(first, self._int(1), lanes),
                           tirx.Broadcast(self.queries - 1, lanes))
        # stmt_seq: a head of width 1 is one statement, which a SeqStmt may not hold
        gathered = tirx.stmt_seq(*[tirx.BufferStore(query_tile, tirx.BufferLoad(self.q, [
            tirx.Broadcast(q_base + element * element_stride, lanes)
            + clamped * tirx.Broadcast(row_stride, lanes)]), [self._vector(element)])
            for element in range(self.depth)])
        rows = self._query_rows(q_base + first * row_stride, row_stride, element_stride)
        whole_tile = gathered if rows is None else tirx.stmt_seq(*[
            tirx.BufferStore(query_tile, tirx.Shuffle(
                rows, [tirx.const(query * self.depth + element, "int32")
                       for query in range(lanes)]), [self._vector(element)])
            for element in range(self.depth)])
        columns = [tirx.Var(f"query_element{element}", f"{dtype}x{lanes}")
                   for element in range(self.depth)]
        gathers = [tirx.AllocBuffer(query_tile),
                   tirx.IfThenElse(first + lanes <= self.queries, whole_tile, gathered),
                   *[tirx.Bind(column, tirx.BufferLoad(query_tile, [self._vector(element)]))
                     for element, column in enumerate(columns)]]

        key_row_stride, key_element_stride = self.k_layout.strides[-2:]

        def key_element(element):
            index = k_base + key * key_row_stride + element * key_element_stride
            return tirx.Broadcast(tirx.BufferLoad(self.k, [index]), lanes)

        score = functools.reduce(operator.add, [key_element(element) * column
                                                for element, column in enumerate(columns)])
        factor = tirx.Var("scale_factor", dtype)
        scaling = []
        if self.scales:
            numbers = [tirx.BufferLoad(scale, [self._int(0)] * len(scale.shape))
                        for scale, _ in self.scales]
            factors = [number if op == MULTIPLY else tirx.const(1, dtype) / number
                       for number, (_, op) in zip(numbers, self.scales)]
            scaling = [tirx.Bind(factor, functools.reduce(operator.mul, factors))]
            score = score * tirx.Broadcast(factor, lanes)
        masking = []
        if self.mask is not None:
            mask_row_stride, mask_key_stride = self.mask_layout.strides[-2:]
            at_mask_key = mask_base + key * mask_key_stride
            if _is_constant(mask_row_stride, 0):  # one mask row for all queries: a number a key
                score = score + tirx.Broadcast(tirx.BufferLoad(self.mask, [at_mask_key]), lanes)
            else:  # the tile's queries' rows, the lanes past the last query repeating it
                mask_rows = tirx.Var("mask_rows", f"{self.index_type}x{lanes}")
                masking = [tirx.Bind(mask_rows, clamped * tirx.Broadcast(mask_row_stride, lanes))]
                score = score + tirx.BufferLoad(
                    self.mask, [tirx.Broadcast(at_mask_key, lanes) + mask_rows])
        key_score = tirx.Var("key_score", f"{dtype}x{lanes}")
        scores_pass = tirx.For(key, self._int(0), self.keys, tirx.ForKind.SERIAL, tirx.SeqStmt([
            tirx.Bind(key_score, score),
            tirx.BufferStore(scores, key_score, [at_key]),
            tirx.BufferStore(peak, tirx.max(tirx.BufferLoad(peak, [vector]), key_score),
                             [vector])]))
        probability = tirx.Var("probability", f"{dtype}x{lanes}")
        exponentials_pass = tirx.For(key, self._int(0), self.keys, tirx.ForKind.SERIAL,
                                     tirx.SeqStmt([
            tirx.Bind(probability, fast_exp(tirx.BufferLoad(scores, [at_key]) - maximum, lanes)),
            tirx.BufferStore(scores, probability, [at_key]),
            tirx.BufferStore(total, tirx.BufferLoad(total, [vector]) + probability, [vector])]))
        lowest = tirx.const(-3.4028234663852886e38, dtype)
        statements = [
            tirx.Bind(entry, tirx.floordiv(task, self.tiles)),
            tirx.Bind(first, tirx.floormod(task, self.tiles) * lanes),
            *bases,
            *gathers,
            *scaling,
            *masking,
            tirx.AllocBuffer(scores), tirx.AllocBuffer(peak), tirx.AllocBuffer(total),
            tirx.BufferStore(peak, tirx.Broadcast(lowest, lanes), [vector]),
            scores_pass,
            tirx.Bind(maximum, tirx.BufferLoad(peak, [vector])),
            tirx.BufferStore(total, tirx.Broadcast(tirx.const(0, dtype), lanes), [vector]),
            exponentials_pass,
            tirx.Bind(reciprocal, tirx.Broadcast(tirx.const(1, dtype), lanes)
                      / tirx.BufferLoad(total, [vector])),
        ]
        for start, width in value_chunks(self.values, lanes):
            statements += self._weighted_sums(first, v_base, out_base, scores, reciprocal,
                                              start, width)
        return tirx.SeqStmt(statements)

    def _weighted_sums(self, first, v_base, out_base, probabilities: tirx.Buffer, reciprocal,
                       start: int, width: int) -> list[tirx.Stmt]:
        """V's columns [start, start + width) weighted by the tile's probabilities, summed over
        the keys, and stored: a whole tile a vector per column, strided along the output's
        rows; the last, partial one through a stack array, lane by lane."""
        lanes, dtype = self.lanes, "float32"
        sums = tirx.decl_buffer((width * lanes,), dtype, "tile_sums", scope="global")
        key = tirx.Var("key", self.index_type)
        probability = tirx.Var("probability", f"{dtype}x{lanes}")

        def at(column):
            return tirx.Ramp(self._int(column * lanes), self._int(1), lanes)

        key_stride, column_stride = self.v_layout.strides[-2:]

        def value(column):
            index = v_base + key * key_stride + (start + column) * column_stride
            return tirx.Broadcast(tirx.BufferLoad(self.v, [index]), lanes)

        accumulate = tirx.For(key, self._int(0), self.keys, tirx.ForKind.SERIAL, tirx.SeqStmt([
            tirx.Bind(probability, tirx.BufferLoad(
                probabilities, [tirx.Ramp(key * lanes, self._int(1), lanes)])),
            *[tirx.BufferStore(sums, tirx.BufferLoad(sums, [at(column)]) + value(column)
                               * probability, [at(column)]) for column in range(width)]]))
        row_stride = self.out_strides[-2]
        base = out_base + first * row_stride + start
        weighted = [tirx.Var(f"weighted{column}", f"{dtype}x{lanes}") for column in range(width)]
        whole = tirx.SeqStmt([
            *[tirx.Bind(var, tirx.BufferLoad(sums, [at(column)]) * reciprocal)
              for column, var in enumerate(weighted)],
            *[tirx.BufferStore(self.out, _query_row(weighted, query, lanes),
                               [_span(base + query * row_stride, width)])
              for query in range(lanes)]])
        lane = tirx.Var("lane", self.index_type)
        column_var = tirx.Var("column", self.index_type)
        partial = tirx.SeqStmt([
            *[tirx.BufferStore(sums, tirx.BufferLoad(sums, [at(column)]) * reciprocal,
                               [at(column)]) for column in range(width)],
            tirx.For(lane, self._int(0), self.queries - first, tirx.ForKind.SERIAL, tirx.For(
                column_var, self._int(0), self._int(width), tirx.ForKind.SERIAL,
                tirx.BufferStore(self.out, tirx.BufferLoad(sums, [column_var * lanes + lane]),
                                 [base + lane * row_stride + column_var])))])
        return [tirx.AllocBuffer(sums),
                *[tirx.BufferStore(sums, tirx.Broadcast(tirx.const(0, dtype), lanes), [at(column)])
                  for column in range(width)],
                accumulate,
                tirx.IfThenElse(first + lanes <= self.queries, whole, partial)]

    def _batch_index(self, entry) -> list:
        """The batch index of batch entry `entry` (the outermost axis needs no modulo: entry is
        below the entries' count, and a division by a run-time extent costs tens of cycles)."""
        index, rest = [], entry
        for axis in reversed(range(1, len(self.batch))):
            index.append(tirx.floormod(rest, self.batch[axis]))
            rest = tirx.floordiv(rest, self.batch[axis])
        return [rest, *reversed(index)] if self.batch else []

    def _query_rows(self, start, row_stride, element_stride) -> list | None:
        """A whole tile's queries as vectors whose lanes, in order, are query 0's elements,
        then query 1's, ...: `depth` vectors of `lanes` where the tile's rows lie next to each
        other, a vector per query where each row's elements do; None where neither."""
        if not _is_constant(element_stride, 1):
            return None
        if _is_constant(row_stride, self.depth):
            return [tirx.BufferLoad(self.q, [tirx.Ramp(start + index * self.lanes, self._int(1),
                                                       self.lanes)])
                    for index in range(self.depth)]
        if self.depth == 1:
            return None
        return [tirx.BufferLoad(self.q, [tirx.Ramp(start + query * row_stride, self._int(1),
                                                   self.depth)])
                for query in range(self.lanes)]

    def _vector(self, index: int):
        """The index of a stack array's vector `index`."""
        return tirx.Ramp(self._int(index * self.lanes), self._int(1), self.lanes)

    def _int(self, value: int):
        return tirx.const(value, self.index_type)


def _query_row(columns: list[tirx.Var], query: int, lanes: int):
    """Lane `query` of each of `columns`' vectors, as a vector (a scalar for one column)."""
    if len(columns) == 1:
        return tirx.Shuffle(columns, [tirx.const(query, "int32")])
    return tirx.Shuffle(columns, [tirx.const(column * lanes + query, "int32")
                                  for column in range(len(columns))])


def _span(start, count: int):
    return start if count == 1 else tirx.Ramp(start, tirx.const(1, start.ty.dtype), count)


def _is_constant(expr, value: int) -> bool:
    return isinstance(expr, tirx.IntImm) and int(expr) == value


def _size(buffer: tirx.Buffer):
    return functools.reduce(operator.mul, buffer.shape, tirx.const(1, "int64"))
