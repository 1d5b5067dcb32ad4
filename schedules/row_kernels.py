"""Softmax and layer norm over the last axis, rows in vector chunks (issue 5: the
memory-bound ops).

TOPI writes both as several loop nests over the whole tensor with per-row temporaries (softmax:
the row maxima, the exponentials into a temporary as large as the input, their sums, the
quotients; layer norm: the sums, the means, the squared deviations' sums, the output). Each inner
loop runs over a row, which LLVM's loop vectorizer gives a vector body, trip-count checks and a
scalar remainder, in every nest; the temporaries make round trips through memory.

These kernels make a few passes over each row while it sits in L1, with no temporary:
- softmax: the row's maximum; exp(x - maximum) written to the output while its sum accumulates;
  the output multiplied by the sum's reciprocal;
- layer norm: the mean; the variance, as the mean of squared deviations (as TOPI and onnxruntime
  compute it: the sum of squares minus the squared mean cancels on rows with a large mean); the
  output (x - mean) / sqrt(variance + epsilon) x gamma + beta.
Sums and maxima accumulate in a vector, folded across lanes once per row. Rows go in groups of
ROW_GROUP, each pass made for every row of the group before the next pass. A row is moved in
whole vectors, then, if the width is not a multiple of the vector, one vector shifted back to the
row's end, its lanes already covered masked out of sums (`_Row.over_row`; softmax's scaling,
which rewrites its output in place, loads that vector first, `_Row.rewrite_in_place`); a row
narrower than a vector in row_chunks.chunk_steps' chunks (at most one of each narrower power of
two, then single elements), so a 5-wide row is a 4-lane chunk and an element. Over a symbolic
width the kinds are versions of the kernel, chosen by the width (`_tail_buckets`). Softmax
alone, shifted vectors against chunks in every pass, median of 15 alternating pairs (AVX2
host): rows of 16 / 20 / 33 / 77 / 128 floats -19 / -21 / -8 / -9 / -7%; layer norm, whose
widths are static (the chunks' checks resolved when compiled), within 2%. Where masked moves
cost what plain ones do (AVX-512), a row of a symbolic width of at most a vector is one masked
vector instead. Softmax alone, that against the chunks (the shifted vector at 16), median of 15
alternating pairs (Zen 4 host, 16 lanes), over 3x4x3x3 / 1x4x5x5 / 2x4x7x7 / 1x4x9x9 /
3x4x12x12 / 3x4x15x15 / 3x4x16x16: -28 / -8 / -46 / -10 / -14 / -56 / -3%; over rows of one
float 0.05 against 0.04 us. The exponential is
TOPI's fast_exp (range reduction to 2^n x a polynomial; its coefficients are Cephes' expf),
written for vectors. Rows run in parallel above the parallel threshold and serially below
it (dispatch.parallel_buckets), as the loops fallback_cpu.py schedules.

Measured alone against TOPI's with the fallback schedule (bench/memory_bound_kernels.py, AVX2
host, median of the per-turn ratios): softmax over 1 x 4 x 128 x 128 0.56x, 2 x 4 x 33 x 33
0.69x, 3 x 4 x 16 x 16 0.57x, 1 x 4 x 5 x 5 0.37x; layer norm over 3 x 16 x 32 0.21x, 1 x 5 x 32
0.27x, and over 1 x 128 x 256 even to 1.14x (9.0 us each on one thread: on rows that wide
LLVM's vectorized fallback loops do as well).

Recognized: an unfused PrimFunc of TOPI's fast_softmax or layer_norm over the last axis only,
float32 (its blocks and nothing else). One with an elementwise consumer fused into it, or over
other axes, keeps the fallback schedule.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable

from tvm import s_tir, tirx
from tvm.ir.expr import Call
from tvm.tirx.op import masked_load, masked_store

from .dispatch import loop_work, nested_ifs, parallel_buckets
from .fallback_cpu import has_root_block
from .isa import VectorISA
from .row_chunks import chunk_steps, element_steps, narrowest_chunk

SOFTMAX_BLOCKS = frozenset({"T_softmax_maxelem", "T_softmax_delta", "T_fast_exp",
                            "T_softmax_expsum", "T_softmax_norm"})
# TOPI names a layer norm's first three blocks after its input
LAYER_NORM_SUFFIXES = ("_sum", "_mean", "_var_sum")
LAYER_NORM_OUT = "T_layer_norm"

# TOPI's fast_exp: the input clamped to where float32 exp is finite, e = 2^n x p(r) with
# n = round(x / ln 2) and r = x - n ln 2, p(r) = 1 + r + r^2 (c5 + r (c4 + ... r c0))
EXP_LIMIT = 88.3762626647949
LOG2E = 1.44269504088896341
LN2 = 0.6931471805599453
EXP_POLYNOMIAL = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                  1.6666665459e-1, 5.0000001201e-1)


def schedule_row_kernel(func: tirx.PrimFunc, isa: VectorISA,
                        min_parallel_work: int) -> tirx.PrimFunc | None:
    """The row kernel in place of `func`'s body, or None when `func` is neither a last-axis
    float32 softmax nor layer norm."""
    if not has_root_block(func):
        return None
    sch = s_tir.Schedule(func)
    blocks = {sch.get(block).name_hint: sch.get(block)
              for block in sch.get_child_blocks(sch.get_sblock("root"))}
    if _is_last_axis_softmax(func, blocks):
        def version(parallel, tail):
            return softmax_rows(*func.params, isa.lanes, parallel, tail)
    elif (epsilon := _last_axis_layer_norm_epsilon(func, blocks)) is not None:
        def version(parallel, tail):
            return layer_norm_rows(*func.params, epsilon, isa.lanes, parallel, tail)
    else:
        return None
    threads = parallel_buckets(loop_work(sch), min_parallel_work)
    versions = [(width_condition, nested_ifs([(condition, version(parallel, tail))
                                              for parallel, condition in threads]))
                for tail, width_condition in _tail_buckets(func.params[0].shape[-1], isa)]
    return func.with_body(nested_ifs(versions)).with_attr("tirx.is_scheduled", True)


# How a row's end that is not a whole vector is moved (`_Row.over_row`)
SHIFTED = "one vector shifted back to the row's end"  # rows of a vector or more
CHUNKED = "narrower chunks, then elements"  # rows narrower than a vector
MASKED = "the whole row in one masked vector"  # rows of at most a vector, fast masks only


def _tail_buckets(width, isa: VectorISA) -> list[tuple[str, object]]:
    """[(tail, run-time condition or None for "otherwise")]: a row of a vector or more ends in
    one vector shifted back to its end. A narrower row of a symbolic width is one masked
    vector where masks are fast (isa.VectorISA.fast_masks), else it goes in chunks, as one of
    a static width does: their checks are resolved when compiled (a layer norm over 3 x 16 x
    12 took 11% longer masked)."""
    if isinstance(width, tirx.IntImm):
        return [(SHIFTED if width.value >= isa.lanes else CHUNKED, None)]
    if isa.fast_masks:
        return [(MASKED, width <= isa.lanes), (SHIFTED, None)]
    return [(SHIFTED, width >= isa.lanes), (CHUNKED, None)]


def softmax_rows(data: tirx.Buffer, out: tirx.Buffer, lanes: int, parallel: bool,
                 tail: str) -> tirx.Stmt:
    """The loop over the rows of `data` (softmax along its last axis) writing `out`, ending
    each row as `tail` says (`_tail_buckets`: each tail holds for some widths only)."""
    rows = _Rows(data, out, lanes, tail)
    x, y = rows.views
    lowest = tirx.const(-3.4028234663852886e38, data.dtype)

    def stages(row: _Row) -> list[list[tirx.Stmt]]:
        maximum = tirx.Var("row_maximum", data.dtype)
        reciprocal = tirx.Var("row_reciprocal", data.dtype)
        peak = row.accumulator("row_peak")
        total = row.accumulator("row_total")

        def exponential(column, count):
            return fast_exp(row.at(x, column, count) - _splat(maximum, count), count)

        def exp_chunk(column, count, slot, fresh):
            # summed from registers: read back from the output, a shifted tail's load would
            # straddle the previous vector's store and miss store forwarding
            value = exponential(column, count)
            exponentials = tirx.Var("exponentials", value.ty.dtype)
            return tirx.SeqStmt([tirx.Bind(exponentials, value),
                                 row.store(y, exponentials, column, count),
                                 row.accumulate(total, exponentials, count, operator.add, slot,
                                                fresh)])


        return [
            [*row.start(peak, lowest),
             *row.over_row(lambda column, count, slot, fresh: row.accumulate(
                 peak, row.at(x, column, count), count, tirx.max, slot, fresh))],
            [tirx.Bind(maximum, row.fold(peak, tirx.max)),
             *row.start(total, tirx.const(0, data.dtype)),
             *row.over_row(exp_chunk)],
            [tirx.Bind(reciprocal, tirx.const(1, data.dtype) / row.fold(total, operator.add)),
             *row.rewrite_in_place(y, lambda values, count: values * _splat(reciprocal, count))],
        ]

    return rows.loop(parallel, stages)


def layer_norm_rows(data: tirx.Buffer, gamma: tirx.Buffer, beta: tirx.Buffer, out: tirx.Buffer,
                    epsilon: float, lanes: int, parallel: bool, tail: str) -> tirx.Stmt:
    """The loop over the rows of `data` (layer norm along its last axis) writing `out`, ending
    each row as `tail` says (`_tail_buckets`)."""
    rows = _Rows(data, out, lanes, tail)
    x, y = rows.views
    dtype = data.dtype
    width = tirx.Cast(dtype, rows.width)
    zero = tirx.const(0, dtype)

    def stages(row: _Row) -> list[list[tirx.Stmt]]:
        mean = tirx.Var("row_mean", dtype)
        inverse_deviation = tirx.Var("row_inverse_deviation", dtype)
        total = row.accumulator("row_total")
        squares = row.accumulator("row_squares")

        def deviation(column, count):
            return row.at(x, column, count) - _splat(mean, count)

        def square_chunk(column, count, slot, fresh):
            return row.accumulate(squares, deviation(column, count) * deviation(column, count),
                                  count, operator.add, slot, fresh)

        def out_chunk(column, count, _, __):
            scaled = deviation(column, count) * _splat(inverse_deviation, count)
            return row.store(y, scaled * row.along(gamma, column, count)
                             + row.along(beta, column, count), column, count)

        return [
            [*row.start(total, zero),
             *row.over_row(lambda column, count, slot, fresh: row.accumulate(
                 total, row.at(x, column, count), count, operator.add, slot, fresh))],
            [tirx.Bind(mean, row.fold(total, operator.add) / width),
             *row.start(squares, zero),
             *row.over_row(square_chunk)],
            [tirx.Bind(inverse_deviation, tirx.const(1, dtype) / tirx.sqrt(
                row.fold(squares, operator.add) / width + tirx.const(epsilon, dtype))),
             *row.over_row(out_chunk)],
        ]

    return rows.loop(parallel, stages)


# Rows a loop iteration runs together, stage by stage (every row's maximum, then every row's
# exponentials, ...): one row's passes wait on each other (a fold across lanes, the
# exponential's polynomial, a division), and rows taken one at a time left the vector units
# idle. Alone, 4 rows against 1, median of 15 alternating pairs (AVX2 host): softmax over rows
# of 5 / 16 / 33 / 128 floats -8 / -12 / -19 / -3%, layer norm over 1x5x32 / 3x16x32 /
# 1x128x32 -2 / -12 / -14%. 8 rows were no faster than 4.
ROW_GROUP = 4
# Vector accumulators per sum or maximum of a row of a known width of that many vectors or
# more (slots, folded together at the row's end): one accumulator made a wide row's pass a chain
# of dependent adds (a 256-wide layer norm's sum: 32 of them). Alone, against one: layer norm
# over 1x128x256 -31%, 3x16x32 -9%. A row of symbolic width (softmax over a sequence) keeps
# one: the slots' starts and folds cost short rows more than the chains (+13 to +32% on
# softmax rows of 5 to 33).
ROW_ACCUMULATORS = 4


class _Rows:
    """A tensor and its output seen as rows along the last axis, and the loop over the rows
    whose body is built per row (`_Row`) in stages."""

    def __init__(self, data: tirx.Buffer, out: tirx.Buffer, lanes: int, tail: str):
        *leading, self.width = data.shape
        self.lanes = lanes
        self.tail = tail
        self.index_type = self.width.ty.dtype
        self.count = functools.reduce(operator.mul, leading, tirx.const(1, self.index_type))
        wide = isinstance(self.width, tirx.IntImm) and self.width.value >= ROW_ACCUMULATORS * lanes
        self.slots = ROW_ACCUMULATORS if wide else 1
        self.sources = (data, out)
        self.views = tuple(tirx.decl_buffer((self.count, self.width), buffer.dtype,
                                            f"{buffer.name}_rows", data=buffer.data)
                           for buffer in self.sources)

    def loop(self, parallel: bool,
             stages: Callable[[_Row], list[list[tirx.Stmt]]]) -> tirx.Stmt:
        """The loop over groups of ROW_GROUP rows, running `stages(row)` of a group's rows
        stage by stage, in parallel when `parallel` (each row's accumulators allocated per
        iteration: per thread); then the rows left, one at a time."""
        group = tirx.Var("row_group", self.index_type)
        row = tirx.Var("row", self.index_type)
        grouped_rows = tirx.floordiv(self.count, ROW_GROUP) * ROW_GROUP
        kind = tirx.ForKind.PARALLEL if parallel else tirx.ForKind.SERIAL
        loops = [
            tirx.For(group, tirx.const(0, self.index_type), tirx.floordiv(self.count, ROW_GROUP),
                     kind, _stage_by_stage([_Row(self, group * ROW_GROUP + offset)
                                            for offset in range(ROW_GROUP)], stages)),
            tirx.For(row, grouped_rows, self.count - grouped_rows, tirx.ForKind.SERIAL,
                     _stage_by_stage([_Row(self, row)], stages)),
        ]
        views = [tirx.DeclBuffer(view, data=source.data)
                 for view, source in zip(self.views, self.sources)]
        return tirx.SeqStmt(views + loops)


def _stage_by_stage(rows: list[_Row], stages: Callable[[_Row], list[list[tirx.Stmt]]]) -> tirx.Stmt:
    """Every row's accumulators, then the first stage of each of `rows`, then the second..."""
    per_row = [stages(row) for row in rows]
    interleaved = [stmt for stage in zip(*per_row) for row_stage in stage for stmt in row_stage]
    return tirx.SeqStmt([allocation for row in rows for allocation in row.allocations]
                        + interleaved)


class _Row:
    """The pieces of one row's body: loads and stores of a chunk of `count` columns at
    `column` in the row, vector accumulators, and folds of them."""

    def __init__(self, rows: _Rows, index):
        self.rows = rows
        self.index = index
        self.allocations: list[tirx.Stmt] = []

    def at(self, view, column, count: int):
        indices = [self.index, _lanes(column, count)]
        if self.rows.tail == MASKED:
            return masked_load(f"{view.dtype}x{count}", view, *indices, self._in_row())
        return tirx.BufferLoad(view, indices)

    def along(self, parameter: tirx.Buffer, column, count: int):
        """A chunk of a parameter that runs along the row (a layer norm's gamma or beta)."""
        if self.rows.tail == MASKED:
            return masked_load(f"{parameter.dtype}x{count}", parameter, _lanes(column, count),
                               self._in_row())
        return tirx.BufferLoad(parameter, [_lanes(column, count)])

    def store(self, view, value, column, count: int) -> tirx.Stmt:
        indices = [self.index, _lanes(column, count)]
        if self.rows.tail == MASKED:
            return tirx.Evaluate(masked_store(view, value, *indices, self._in_row()))
        return tirx.BufferStore(view, value, indices)

    def accumulator(self, name: str) -> tirx.Buffer:
        """A vector accumulator of the row's body, a vector per slot: a "global" stack array,
        which LLVM keeps in registers (isa.py)."""
        buffer = tirx.decl_buffer((self.rows.slots * self.rows.lanes,),
                                  self.rows.views[0].dtype, name, scope="global")
        self.allocations.append(tirx.AllocBuffer(buffer))
        return buffer

    def start(self, accumulator: tirx.Buffer, value) -> list[tirx.Stmt]:
        lanes = self.rows.lanes
        return [tirx.BufferStore(accumulator, tirx.Broadcast(value, lanes),
                                 [self._slot(slot, lanes)]) for slot in range(self.rows.slots)]

    def accumulate(self, accumulator: tirx.Buffer, value, count: int, combine,
                   slot: int, fresh=None) -> tirx.Stmt:
        """`value` combined into the accumulator's slot; only its `fresh` lanes, if given."""
        index = self._slot(slot, count)
        current = tirx.BufferLoad(accumulator, [index])
        combined = combine(current, value)
        if fresh is not None:
            combined = tirx.Select(fresh, combined, current)
        return tirx.BufferStore(accumulator, combined, [index])

    def over_row(self, chunk_body) -> list[tirx.Stmt]:
        """`chunk_body(column, count, slot, fresh)` over the whole row: a vector per slot at a
        time, each into its own accumulator slot, then the rest into slot 0, `fresh` None but
        for a shifted tail.

        The rest, for rows of at least a vector (`SHIFTED`): the whole vectors left,
        then, where the width is not a multiple of the vector, one vector ending at the row's
        end, its `fresh` lanes (a mask) those the vectors before it did not cover. Its chunk
        body combines only those into accumulators, and stores into the others what they hold
        already (values computed from the input alone; a pass that rewrites the output in
        place is `rewrite_in_place`). Rows narrower than a vector take the rest in chunks of
        narrower powers of two, then single elements. Under a symbolic width those chunks' and
        elements' checks, in every pass over every row, cost as much as the loops doing the
        work: a softmax over 3 x 4 x 16 x 16 took 3.29 us alone, 2.50 us with no checks at all
        (wrong at other widths), 2.14 us at a static width.

        A row of at most a vector where masks are fast (`MASKED`) is one vector, its lanes
        past the row's end masked out of loads, stores and accumulators: no loop and no check.
        """
        rows = self.rows
        if rows.tail == MASKED:
            return [chunk_body(tirx.const(0, rows.index_type), rows.lanes, 0, self._in_row())]
        whole, done = self._whole_vectors(chunk_body)
        if rows.tail == SHIFTED:
            return whole + [tirx.IfThenElse(self._remainder() != 0, chunk_body(
                rows.width - rows.lanes, rows.lanes, 0, self._fresh_lanes()), None)]
        chunks, covered = chunk_steps(rows.width - done, rows.lanes, rows.index_type,
                                      lambda column, count: chunk_body(done + column, count, 0,
                                                                       None))
        return [*whole, *chunks, *element_steps(done + covered, rows.width,
                                                narrowest_chunk(rows.lanes) - 1,
                                                lambda column: chunk_body(column, 1, 0, None))]

    def rewrite_in_place(self, view, update) -> list[tirx.Stmt]:
        """The row of `view` replaced by `update(values, count)`, chunk by chunk. A shifted last
        vector is loaded before the vectors it overlaps are rewritten, and stored, updated in
        every lane, after them: its overlapped lanes then get what those vectors wrote.
        Against chunks in this pass alone (the others shifted), softmax over rows of 20 / 33
        floats went from -10 / -3% to -21 / -8% (module docstring); recomputing the tail's
        exponentials instead, to rewrite its overlap as it was, cost +14 / +6%."""
        def chunk(column, count, _, __):
            return self.store(view, update(self.at(view, column, count), count), column, count)

        rows = self.rows
        if rows.tail != SHIFTED:
            return self.over_row(chunk)
        last_column = rows.width - rows.lanes
        last = tirx.Var("row_last_vector", f"{view.dtype}x{rows.lanes}")
        whole, _ = self._whole_vectors(chunk)
        return [tirx.Bind(last, self.at(view, last_column, rows.lanes)), *whole,
                tirx.IfThenElse(self._remainder() != 0, self.store(
                    view, update(last, rows.lanes), last_column, rows.lanes), None)]

    def _whole_vectors(self, chunk_body) -> tuple[list[tirx.Stmt], object]:
        """`chunk_body` over the row's whole groups of a vector per slot, and, for a shifted
        tail, the whole vectors after them; and the columns the groups cover."""
        rows = self.rows
        lanes, width, index_type = rows.lanes, rows.width, rows.index_type
        step = rows.slots * lanes
        group = tirx.Var("vector_group", index_type)
        slots = [chunk_body(group * step + slot * lanes, lanes, slot, None)
                 for slot in range(rows.slots)]
        steps = [tirx.For(group, tirx.const(0, index_type), tirx.floordiv(width, step),
                          tirx.ForKind.SERIAL, slots[0] if len(slots) == 1 else tirx.SeqStmt(slots))]
        done = tirx.floordiv(width, step) * step
        if rows.tail == SHIFTED and rows.slots > 1:
            vector = tirx.Var("vector", index_type)
            steps.append(tirx.For(vector, tirx.const(0, index_type),
                                  tirx.floordiv(width - done, lanes), tirx.ForKind.SERIAL,
                                  chunk_body(done + vector * lanes, lanes, 0, None)))
        return steps, done

    def _remainder(self):
        return tirx.floormod(self.rows.width, self.rows.lanes)

    def _in_row(self):
        """The lanes of a vector at the row's start that lie inside the row."""
        lanes = self.rows.lanes
        return (tirx.Ramp(tirx.const(0, "int32"), tirx.const(1, "int32"), lanes)
                < tirx.Broadcast(tirx.Cast("int32", self.rows.width), lanes))

    def _fresh_lanes(self):
        """The lanes of the row's last vector, shifted back to its end, that the whole vectors
        before it did not cover."""
        lanes = self.rows.lanes
        return (tirx.Ramp(tirx.const(0, "int32"), tirx.const(1, "int32"), lanes)
                >= tirx.Broadcast(tirx.Cast("int32", lanes - self._remainder()), lanes))

    def _slot(self, slot: int, count: int):
        return _lanes(tirx.const(slot * self.rows.lanes, self.rows.index_type), count)

    def fold(self, accumulator: tirx.Buffer, combine):
        """The vector in `accumulator` folded into one value, halving it in registers (Shuffles
        of a Let-bound vector): halves stored and reloaded through the stack array missed x86's
        store forwarding, a stall per halving (a 16-wide softmax row took 58 cycles)."""
        lanes = self.rows.lanes
        vector = functools.reduce(combine, [tirx.BufferLoad(accumulator, [self._slot(slot, lanes)])
                                            for slot in range(self.rows.slots)])
        while lanes > 1:
            half = lanes // 2
            whole = tirx.Var(f"lanes{lanes}", vector.ty.dtype)
            low = tirx.Shuffle([whole], [tirx.const(i, "int32") for i in range(half)])
            high = tirx.Shuffle([whole], [tirx.const(i, "int32") for i in range(half, lanes)])
            vector = tirx.Let(whole, vector, combine(low, high))
            lanes = half
        return vector


def fast_exp(value, count: int):
    """TOPI's fast_exp of a float32 vector of `count` lanes (or a scalar when 1)."""
    dtype = value.ty.dtype

    def splat(number):
        return _splat(tirx.const(number, "float32"), count)

    clamped = tirx.Var("clamped", dtype)
    power = tirx.Var("power", dtype)
    reduced = tirx.Var("reduced", dtype)
    polynomial = splat(EXP_POLYNOMIAL[0])
    for coefficient in EXP_POLYNOMIAL[1:]:
        polynomial = polynomial * reduced + splat(coefficient)
    polynomial = polynomial * reduced * reduced + reduced + splat(1.0)
    int_type = "int32" if count == 1 else f"int32x{count}"
    exponent = (tirx.Cast(int_type, power) + _splat(tirx.const(127, "int32"), count)) \
        << _splat(tirx.const(23, "int32"), count)
    two_to_power = tirx.reinterpret(dtype, exponent)
    return tirx.Let(clamped, tirx.max(tirx.min(value, splat(EXP_LIMIT)), splat(-EXP_LIMIT)),
                    tirx.Let(power, tirx.floor(clamped * splat(LOG2E) + splat(0.5)),
                             tirx.Let(reduced, clamped - power * splat(LN2),
                                      two_to_power * polynomial)))


def _lanes(start, count: int):
    return start if count == 1 else tirx.Ramp(start, tirx.const(1, start.ty.dtype), count)


def _splat(value, count: int):
    return value if count == 1 else tirx.Broadcast(value, count)


def _is_last_axis_softmax(func: tirx.PrimFunc, blocks: dict) -> bool:
    if set(blocks) != SOFTMAX_BLOCKS or len(func.params) != 2:
        return False
    data, out = func.params
    axis = blocks["T_softmax_norm"].annotations.get("axis")
    return (data.dtype == out.dtype == "float32" and axis is not None
            and int(axis) == len(data.shape) - 1)


def _last_axis_layer_norm_epsilon(func: tirx.PrimFunc, blocks: dict) -> float | None:
    """The epsilon of a TOPI layer norm over the last axis only (float32, a gamma and a beta
    along that axis), read from its output block's rsqrt(variance + epsilon); else None."""
    if len(blocks) != 4 or LAYER_NORM_OUT not in blocks or len(func.params) != 4:
        return None
    data, gamma, beta, out = func.params
    means = [name for name in blocks if name.endswith("_mean")]
    if len(means) != 1:
        return None
    prefix = means[0][:-len("_mean")]
    if {prefix + suffix for suffix in LAYER_NORM_SUFFIXES} != set(blocks) - {LAYER_NORM_OUT}:
        return None
    row_stats = blocks[means[0]].writes[0].source
    if (any(buffer.dtype != "float32" for buffer in func.params)
            or len(row_stats.shape) != len(data.shape) - 1
            or any(len(buffer.shape) != 1 for buffer in (gamma, beta))):
        return None
    store = blocks[LAYER_NORM_OUT].body
    epsilons = _rsqrt_epsilons(store.value) if isinstance(store, tirx.BufferStore) else []
    return epsilons[0] if len(epsilons) == 1 else None


def _rsqrt_epsilons(expr) -> list[float]:
    """The constant c of each rsqrt(... + c) in the TIR expression `expr`."""
    if isinstance(expr, Call):
        argument = expr.args[0] if expr.args else None
        if (str(expr.op.name) == "tirx.rsqrt" and isinstance(argument, tirx.Add)
                and isinstance(argument.b, tirx.FloatImm)):
            return [argument.b.value]
        return [c for arg in expr.args for c in _rsqrt_epsilons(arg)]
    children = [getattr(expr, name) for name in ("a", "b", "value") if hasattr(expr, name)]
    return [c for child in children if not isinstance(child, (int, float))
            for c in _rsqrt_epsilons(child)]
