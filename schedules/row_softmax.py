"""Softmax over the last axis, a row at a time in vector chunks (issue 5: the memory-bound ops).

TOPI's fast_softmax (UseFastMath) is four loop nests over the whole tensor: the row maxima, the
exponentials into a temporary as large as the input, their sums, the quotients. Each inner loop
runs over a row of symbolic length, which LLVM's loop vectorizer gives a vector body, trip-count
checks and a scalar remainder, four times per row, and the exponentials make a round trip
through memory.

This kernel makes three passes over each row while it sits in L1, with no temporary:
1. the row's maximum, in a vector of running maxima reduced across lanes at the end;
2. exp(x - maximum) written to the output, its sum accumulated in a vector the same way;
3. the output multiplied by the sum's reciprocal.
A row is moved in row_chunks.chunk_steps' chunks (whole vectors, then at most one chunk of each
narrower power of two, then single elements), so a 5-wide row is a 4-lane chunk and an element.
The exponential is TOPI's fast_exp (range reduction to 2^n x a polynomial; its coefficients are
Cephes' expf), written for vectors. Rows run in parallel above the parallel threshold and
serially below it (dispatch.parallel_buckets), as the loops fallback_cpu.py schedules.
transformer_encoder_dynamo's attention softmax alone, TOPI's -> this kernel: 1 x 4 x 128 x 128
67.6 -> 17.2 us, 3 x 4 x 16 x 16 3.9 -> 2.9 us, 1 x 4 x 5 x 5 0.68 -> 0.62 us.

Recognized: an unfused fast_softmax PrimFunc over the last axis of a float32 tensor (TOPI's
blocks and nothing else). A softmax with an elementwise consumer fused into it, or over
another axis, keeps the fallback schedule.
"""

from __future__ import annotations

import functools
import operator

from tvm import s_tir, tirx

from .dispatch import loop_work, parallel_buckets
from .fallback_cpu import has_root_block
from .isa import VectorISA
from .row_chunks import chunk_steps, element_steps, narrowest_chunk

SOFTMAX_BLOCKS = frozenset({"T_softmax_maxelem", "T_softmax_delta", "T_fast_exp", "T_softmax_expsum",
                            "T_softmax_norm"})

# TOPI's fast_exp: the input clamped to where float32 exp is finite, e = 2^n x p(r) with
# n = round(x / ln 2) and r = x - n ln 2, p(r) = 1 + r + r^2 (c5 + r (c4 + ... r c0))
EXP_LIMIT = 88.3762626647949
LOG2E = 1.44269504088896341
LN2 = 0.6931471805599453
EXP_POLYNOMIAL = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                  1.6666665459e-1, 5.0000001201e-1)


def schedule_row_softmax(func: tirx.PrimFunc, isa: VectorISA,
                         min_parallel_work: int) -> tirx.PrimFunc | None:
    """The row kernel in place of `func`'s body, or None when `func` is not a last-axis float32
    fast_softmax."""
    if not has_root_block(func):
        return None
    sch = s_tir.Schedule(func)
    if not _is_last_axis_softmax(func, sch):
        return None
    data, out = func.params
    versions = [(condition, softmax_rows(data, out, isa.lanes, parallel))
                for parallel, condition in parallel_buckets(loop_work(sch), min_parallel_work)]
    body = versions[-1][1]
    for condition, version in reversed(versions[:-1]):
        body = tirx.IfThenElse(condition, version, body)
    return func.with_body(body).with_attr("tirx.is_scheduled", True)


def softmax_rows(data: tirx.Buffer, out: tirx.Buffer, lanes: int, parallel: bool) -> tirx.Stmt:
    """The loop over the rows of `data` (softmax along its last axis) writing `out`."""
    *leading, width = data.shape
    index_type = width.ty.dtype
    rows = functools.reduce(operator.mul, leading, tirx.const(1, index_type))
    x = tirx.decl_buffer((rows, width), data.dtype, "rows", data=data.data)
    y = tirx.decl_buffer((rows, width), out.dtype, "out_rows", data=out.data)
    row = tirx.Var("row", index_type)
    # "global" stack arrays of a vector each, which LLVM keeps in registers (isa.py)
    peak = tirx.decl_buffer((lanes,), data.dtype, "row_peak", scope="global")
    total = tirx.decl_buffer((lanes,), data.dtype, "row_total", scope="global")

    def at(buffer, column, count):
        return tirx.BufferLoad(buffer, [row, _lanes(column, count)])

    def accumulate(accumulator, value, count, combine):
        index = _lanes(tirx.const(0, index_type), count)
        return tirx.BufferStore(accumulator, combine(tirx.BufferLoad(accumulator, [index]), value),
                                [index])

    def over_row(chunk_body):
        """`chunk_body(column, count)` over the whole row, in chunks."""
        chunks, covered = chunk_steps(width, lanes, index_type, chunk_body)
        return chunks + element_steps(covered, width, narrowest_chunk(lanes) - 1,
                                      lambda column: chunk_body(column, 1))

    maximum = tirx.Var("row_maximum", data.dtype)
    reciprocal = tirx.Var("row_reciprocal", data.dtype)

    def exp_chunk(column, count):
        shifted = at(x, column, count) - _splat(maximum, count)
        return tirx.SeqStmt([
            tirx.BufferStore(y, fast_exp(shifted, count), [row, _lanes(column, count)]),
            accumulate(total, at(y, column, count), count, operator.add)])

    def scale_chunk(column, count):
        return tirx.BufferStore(y, at(y, column, count) * _splat(reciprocal, count),
                                [row, _lanes(column, count)])

    lowest = tirx.const(-3.4028234663852886e38, data.dtype)
    body = [
        tirx.AllocBuffer(peak), tirx.AllocBuffer(total),
        tirx.BufferStore(peak, tirx.Broadcast(lowest, lanes), [_lanes(tirx.const(0, index_type), lanes)]),
        *over_row(lambda column, count: accumulate(peak, at(x, column, count), count, tirx.max)),
        tirx.Bind(maximum, _across_lanes(peak, lanes, index_type, tirx.max)),
        tirx.BufferStore(total, tirx.Broadcast(tirx.const(0, data.dtype), lanes),
                         [_lanes(tirx.const(0, index_type), lanes)]),
        *over_row(exp_chunk),
        tirx.Bind(reciprocal, tirx.const(1, data.dtype)
                  / _across_lanes(total, lanes, index_type, operator.add)),
        *over_row(scale_chunk),
    ]
    kind = tirx.ForKind.PARALLEL if parallel else tirx.ForKind.SERIAL
    loop = tirx.For(row, tirx.const(0, index_type), rows, kind, tirx.SeqStmt(body))
    return tirx.SeqStmt([tirx.DeclBuffer(x, data=data.data), tirx.DeclBuffer(y, data=out.data), loop])


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


def _across_lanes(accumulator: tirx.Buffer, lanes: int, index_type: str, combine):
    """The vector in `accumulator` folded into one value, halving it in registers (Shuffles of
    a Let-bound vector): halves stored and reloaded through the stack array missed x86's store
    forwarding, a stall per halving (a 16-wide softmax row took 58 cycles)."""
    vector = tirx.BufferLoad(accumulator, [_lanes(tirx.const(0, index_type), lanes)])
    while lanes > 1:
        half = lanes // 2
        whole = tirx.Var(f"lanes{lanes}", vector.ty.dtype)
        low = tirx.Shuffle([whole], [tirx.const(i, "int32") for i in range(half)])
        high = tirx.Shuffle([whole], [tirx.const(i, "int32") for i in range(half, lanes)])
        vector = tirx.Let(whole, vector, combine(low, high))
        lanes = half
    return vector


def _lanes(start, count: int):
    return start if count == 1 else tirx.Ramp(start, tirx.const(1, start.ty.dtype), count)


def _splat(value, count: int):
    return value if count == 1 else tirx.Broadcast(value, count)


def _is_last_axis_softmax(func: tirx.PrimFunc, sch: s_tir.Schedule) -> bool:
    blocks = {sch.get(block).name_hint: sch.get(block)
              for block in sch.get_child_blocks(sch.get_sblock("root"))}
    if set(blocks) != SOFTMAX_BLOCKS or len(func.params) != 2:
        return False
    data, out = func.params
    axis = blocks["T_softmax_norm"].annotations.get("axis")
    return (data.dtype == out.dtype == "float32" and axis is not None
            and int(axis) == len(data.shape) - 1)
