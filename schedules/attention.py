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
  the key, broadcast, into that element's vector; scaled; kept in a scratch row of `keys`
  vectors, and the maximum so far taken lane by lane;
- for each key: exp(score - maximum) in place, summed lane by lane;
- the weighted sum of V's rows, a chunk of its columns at a time in registers
  (`value_chunks`), a multiply-add of
  each value, broadcast, into the vector of the tile's probabilities of its key; multiplied by
  the reciprocal of the sums and stored, each lane to its query's row.
Maxima and sums run along the keys, so no fold across lanes; K and V are read an element at a
time, so a K given as it is (K^T by a permute_dims that the kernel then does) costs what K^T
does, and neither is packed. The queries of a tile's lanes past the last query repeat it and
are not stored. Tiles (batch entries x query tiles) run in parallel above the parallel
threshold (dispatch.parallel_buckets). The exponential is row_kernels.fast_exp.

`attention` is the same computation as TE computes (TOPI's softmax between two reductions), the
kernel's definition: FuseAttention emits it, ScheduleKernels replaces its body with this
kernel, and a tuner (`tightfit tune`) sees it as one workload.
Limits: fp32; static head widths (Q's and V's last axes); FuseAttention uses it for narrow
heads only (fuse_attention.MAX_HEAD_WIDTH), where it beats the GEMM kernels.
"""

from __future__ import annotations

import functools
import operator

from tvm import te, tirx, topi

from .dispatch import MAC_WORK_DIVISOR, nested_ifs, parallel_buckets
from .isa import FP32_BYTES, MAX_STACK_ALLOCA_BYTES, VectorISA
from .row_kernels import fast_exp

# The PrimFunc attribute that marks the kernel: {"keys_in_rows", "scale", "out_axes"}
ATTENTION_ATTR = "tightfit.attention"
MULTIPLY = "multiply"
DIVIDE = "divide"


def attention(q: te.Tensor, k: te.Tensor, v: te.Tensor, *scale: te.Tensor, keys_in_rows: bool,
              scale_op: str | None, out_axes: tuple[int, ...] | None) -> te.Tensor:
    """softmax(Q K^T (x or / scale)) V over the last axis, Q [*batch, queries, depth],
    V [*batch, keys, values]; K is [*batch, keys, depth] when `keys_in_rows`, else K^T
    [*batch, depth, keys]. `scale` is a 0-d tensor when `scale_op` is given. `out_axes`: the
    result's axes in the order it holds them, the columns last (None: in order)."""
    *batch, queries, depth = q.shape
    keys = k.shape[-2] if keys_in_rows else k.shape[-1]
    values = v.shape[-1]
    element = te.reduce_axis((0, depth), "element")

    def score(*index):
        *b, query, key = index
        key_element = k[(*b, key, element)] if keys_in_rows else k[(*b, element, key)]
        product = te.sum(q[(*b, query, element)] * key_element, axis=element)
        return product

    scores = te.compute((*batch, queries, keys), score, name="attention_scores")
    if scale_op == MULTIPLY:
        scores = te.compute(scores.shape, lambda *index: scores(*index) * scale[0](),
                            name="attention_scaled")
    elif scale_op == DIVIDE:
        scores = te.compute(scores.shape, lambda *index: scores(*index) / scale[0](),
                            name="attention_scaled")
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


def schedule_attention(func: tirx.PrimFunc, isa: VectorISA,
                       min_parallel_work: int) -> tirx.PrimFunc | None:
    """The attention kernel in place of the body of a PrimFunc FuseAttention marked, else None."""
    options = (func.attrs or {}).get(ATTENTION_ATTR)
    if options is None:
        return None
    kernel = _Attention(*func.params, keys_in_rows=bool(options["keys_in_rows"]),
                        scale_op=str(options["scale"]) or None,
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

    def __init__(self, q: tirx.Buffer, k: tirx.Buffer, v: tirx.Buffer, *rest: tirx.Buffer,
                 keys_in_rows: bool, scale_op: str | None, out_axes: list[int], lanes: int):
        *scale, out = rest
        self.scale = scale[0] if scale else None
        self.scale_op = scale_op
        *batch, self.queries, depth = q.shape
        self.keys = k.shape[-2] if keys_in_rows else k.shape[-1]
        self.depth, self.values = int(depth), int(v.shape[-1])
        self.keys_in_rows = keys_in_rows
        self.lanes = lanes
        self.index_type = self.queries.ty.dtype
        self.batch = batch
        self.entries = functools.reduce(operator.mul, batch, tirx.const(1, self.index_type))
        self.tiles = tirx.floordiv(self.queries + lanes - 1, lanes)
        self.sources = (q, k, v, out)
        self.q, self.k, self.v, self.out = (
            tirx.decl_buffer((_size(buffer),), buffer.dtype, f"{buffer.name}_flat",
                             data=buffer.data) for buffer in self.sources)
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
                 for view, source in zip((self.q, self.k, self.v, self.out), self.sources)]
        return tirx.SeqStmt(views + [tirx.For(task, self._int(0), self.entries * self.tiles, kind,
                                              self._tile(task))])

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

        # the tile's queries as lanes, a row of Q^T per element: a whole tile's rows loaded as
        # vectors and transposed in registers; a partial tile's gathered, the lanes past the
        # last query repeating it
        query_tile = tirx.decl_buffer((self.depth * lanes,), dtype, "tile_queries",
                                      scope="global")
        tile_start = (entry * self.queries + first) * self.depth
        rows = [tirx.BufferLoad(self.q, [tirx.Ramp(tile_start + index * lanes, self._int(1),
                                                   lanes)]) for index in range(self.depth)]
        clamped = tirx.min(tirx.Ramp(first, self._int(1), lanes),
                           tirx.Broadcast(self.queries - 1, lanes))
        q_rows = tirx.Broadcast(entry * self.queries, lanes) + clamped
        transposed = tirx.SeqStmt([tirx.BufferStore(query_tile, tirx.Shuffle(
            rows, [tirx.const(query * self.depth + element, "int32") for query in range(lanes)]),
            [self._vector(element)]) for element in range(self.depth)])
        gathered = tirx.SeqStmt([tirx.BufferStore(query_tile, tirx.BufferLoad(
            self.q, [q_rows * self.depth + tirx.Broadcast(self._int(element), lanes)]),
            [self._vector(element)]) for element in range(self.depth)])
        columns = [tirx.Var(f"query_element{element}", f"{dtype}x{lanes}")
                   for element in range(self.depth)]
        gathers = [tirx.AllocBuffer(query_tile),
                   tirx.IfThenElse(first + lanes <= self.queries, transposed, gathered),
                   *[tirx.Bind(column, tirx.BufferLoad(query_tile, [self._vector(element)]))
                     for element, column in enumerate(columns)]]

        def key_element(element):
            if self.keys_in_rows:
                index = (entry * self.keys + key) * self.depth + element
            else:
                index = (entry * self.depth + element) * self.keys + key
            return tirx.Broadcast(tirx.BufferLoad(self.k, [index]), lanes)

        score = functools.reduce(operator.add, [key_element(element) * column
                                                for element, column in enumerate(columns)])
        factor = tirx.Var("scale_factor", dtype)
        scaling = []
        if self.scale is not None:
            scale = tirx.BufferLoad(self.scale, [])
            scaling = [tirx.Bind(factor, scale if self.scale_op == MULTIPLY
                                 else tirx.const(1, dtype) / scale)]
            score = score * tirx.Broadcast(factor, lanes)
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
            *gathers,
            *scaling,
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
            statements += self._weighted_sums(entry, first, scores, reciprocal, start, width)
        return tirx.SeqStmt(statements)

    def _weighted_sums(self, entry, first, probabilities: tirx.Buffer, reciprocal, start: int,
                       width: int) -> list[tirx.Stmt]:
        """V's columns [start, start + width) weighted by the tile's probabilities, summed over
        the keys, and stored: a whole tile a vector per column, strided along the output's
        rows; the last, partial one through a stack array, lane by lane."""
        lanes, dtype = self.lanes, "float32"
        sums = tirx.decl_buffer((width * lanes,), dtype, "tile_sums", scope="global")
        key = tirx.Var("key", self.index_type)
        probability = tirx.Var("probability", f"{dtype}x{lanes}")

        def at(column):
            return tirx.Ramp(self._int(column * lanes), self._int(1), lanes)

        def value(column):
            index = (entry * self.keys + key) * self.values + start + column
            return tirx.Broadcast(tirx.BufferLoad(self.v, [index]), lanes)

        accumulate = tirx.For(key, self._int(0), self.keys, tirx.ForKind.SERIAL, tirx.SeqStmt([
            tirx.Bind(probability, tirx.BufferLoad(
                probabilities, [tirx.Ramp(key * lanes, self._int(1), lanes)])),
            *[tirx.BufferStore(sums, tirx.BufferLoad(sums, [at(column)]) + value(column)
                               * probability, [at(column)]) for column in range(width)]]))
        row_stride = self.out_strides[-2]
        base = self._out_base(entry) + first * row_stride + start
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

    def _out_base(self, entry):
        """Where the batch entry's [queries, values] block starts in the output: its batch
        index, unravelled, times each batch axis's stride."""
        offset, rest = self._int(0), entry
        for axis in reversed(range(len(self.batch))):
            offset = offset + tirx.floormod(rest, self.batch[axis]) * self.out_strides[axis]
            rest = tirx.floordiv(rest, self.batch[axis])
        return offset

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


def _size(buffer: tirx.Buffer):
    return functools.reduce(operator.mul, buffer.shape, tirx.const(1, "int64"))
