"""Max pooling over NCHW maps, a vector of output columns at a time (issue 5: the memory-bound
rest).

TOPI's max_pool2d is a padded copy of the input and a scalar loop over outputs and window taps;
the fallback schedule only parallelizes it, and LLVM does not vectorize it (its taps read the
input at a stride, through the padded copy). Here each output row is built from whole vectors:
for a vector of L output columns starting at `ow`, tap t of the window reads input columns
ow * stride - pad + t + stride * l (l < L). Taps q * stride + r (r < stride) share one load of
stride * L contiguous columns from ow * stride - pad + q * stride, and tap r takes its lanes
r, r + stride, ... by a shuffle (a 2x2 / stride-2 window: two loads and two shuffles per row
of taps). Output columns whose loads would leave the input row (the left and right edges under
padding, and what is left of a row after whole vectors) are computed one at a time with bounds
checks; the last vector of a row is shifted back over the one before it where the row is not a
whole number of vectors (its outputs computed twice, the same values). A row too narrow for a
whole vector (conv_dynamic_hw's 20-wide map pooled to 10 columns) is built from masked vectors
instead: a masked load reads only the lanes inside the input row, the others count as the
lowest float, and a masked store writes only the row's columns (measured: that pool at 12 x 64 x
20 took 7.2 us one column at a time, 2.1 us in masked vectors). Window rows outside the
input are skipped with a check per row. A maximum starts at the lowest float, the value TOPI
pads with, so padded taps change nothing, as in ONNX's MaxPool.

The window's rows (and an edge column's taps) are loops, which LLVM unrolls, not one statement
each: every bounds check is a condition TVM's buffer region analyses reason about, over the map's
symbolic dims: with a statement per tap, grouped_convnet's 3x3 pool took 1.9 s to compile, as
loops 0.7 s.

Recognized: a max_pool2d that LegalizeOps turned into a call of its own PrimFunc, NCHW,
float32, dilation 1, which `legalize_max_pool` marks with its window; not one fused with an
elementwise consumer (MaxPool then Relu), which keeps the fallback schedule.
Planes (image x channel) run in parallel above the parallel threshold (dispatch.py), counting
each output's taps as the scalar loop would.
"""

from __future__ import annotations

import functools
import operator

import tvm
from tvm import relax, s_tir, tirx
from tvm.tirx.op import masked_load, masked_store

from .dispatch import nested_ifs, parallel_buckets
from .fallback_cpu import has_root_block
from .isa import VectorISA

MAX_POOL_OP = "relax.nn.max_pool2d"
# the marked PrimFunc's window: (kernel_h, kernel_w, stride_h, stride_w, pad_top, pad_left)
WINDOW_ATTR = "tightfit.max_pool_window"
LOWEST = -3.4028234663852886e38
# TOPI's blocks: the padded copy of the input (only with padding) and the pooling
PAD_BLOCK = "pad_temp"
POOL_BLOCK = "pool_max"


def legalize_max_pool() -> dict:
    """LegalizeOps' customize map: max_pool2d legalized as TVM does, its PrimFunc marked with
    its window where the kernel below applies."""
    legalize = tvm.ir.Op.get(MAX_POOL_OP).get_attr("FLegalize")

    def legalize_and_mark(builder: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        legalized = legalize(builder, call)
        window = _window(call)
        is_call_tir = (isinstance(legalized, relax.Call)
                       and legalized.op.same_as(tvm.ir.Op.get("relax.call_tir")))
        if window is not None and is_call_tir:
            kernel = legalized.args[0]
            builder.update_func(kernel, builder.get()[kernel].with_attr(WINDOW_ATTR, window))
        return legalized

    return {MAX_POOL_OP: legalize_and_mark}


def schedule_max_pool(func: tirx.PrimFunc, isa: VectorISA,
                      min_parallel_work: int) -> tirx.PrimFunc | None:
    """The vector kernel in place of a marked max_pool2d PrimFunc's body, else None."""
    if WINDOW_ATTR not in (func.attrs or {}) or not _is_pool_alone(func):
        return None
    data, out = (param for param in func.params if hasattr(param, "shape"))
    window = [int(value) for value in func.attrs[WINDOW_ATTR]]
    outputs = functools.reduce(operator.mul, out.shape)
    versions = [(condition, _Pool(data, out, *window, lanes=isa.lanes).loop(parallel))
                for parallel, condition in
                parallel_buckets(outputs * window[0] * window[1], min_parallel_work)]
    return func.with_body(nested_ifs(versions)).with_attr("tirx.is_scheduled", True)


def _is_pool_alone(func: tirx.PrimFunc) -> bool:
    """TOPI's blocks of a max pool and nothing else: FuseTIR drops the mark from a pool fused
    with an elementwise consumer, and this holds if it ever kept it."""
    if not has_root_block(func):
        return False
    sch = s_tir.Schedule(func)
    blocks = {sch.get(block).name_hint for block in sch.get_child_blocks(sch.get_sblock("root"))}
    return blocks in ({POOL_BLOCK}, {PAD_BLOCK, POOL_BLOCK})


def _window(call: relax.Call) -> list[int] | None:
    attrs = call.attrs
    data_ty = call.args[0].ty
    if (str(attrs.layout) != "NCHW" or str(attrs.out_layout) != "NCHW"
            or any(int(d) != 1 for d in attrs.dilation) or data_ty.dtype != "float32"):
        return None
    (kernel_h, kernel_w), (stride_h, stride_w) = attrs.pool_size, attrs.strides
    pad_top, pad_left = attrs.padding[0], attrs.padding[1]
    return [int(value) for value in (kernel_h, kernel_w, stride_h, stride_w, pad_top, pad_left)]


def row_taps(data: tirx.Buffer, row: list, start, kernel_w: int, stride_w: int, pad_left: int,
             lanes: int, fill: float | None = None) -> list:
    """The window's taps along one input row for the outputs start .. start + lanes - 1 of an
    output row, one vector per kernel column: tap rx of output l reads column
    start * stride - pad + rx + stride * l of `data` at the indices `row` (the row's leading
    ones). Taps q * stride + r share one load of stride * lanes columns and take lanes r,
    r + stride, ... of it by a shuffle. With `fill`, the loads are masked to the row's columns
    and the lanes outside it are `fill` (the padding's value to the consumer); without, every
    load must lie inside the row."""
    width = data.shape[-1]
    index_type = width.ty.dtype
    span = stride_w * lanes
    taps = []
    for group in range(-(-kernel_w // stride_w)):
        base = start * stride_w - pad_left + group * stride_w
        indices = [*row, tirx.Ramp(base, tirx.const(1, index_type), span)]
        if fill is None:
            loaded = tirx.BufferLoad(data, indices)
        else:
            # in 32-bit lanes: 64-bit ones took four compares per 32-lane mask
            offsets = tirx.Ramp(tirx.const(0, "int32"), tirx.const(1, "int32"), span)
            inside = tirx.And(offsets >= tirx.Broadcast(tirx.Cast("int32", -base), span),
                              offsets < tirx.Broadcast(tirx.Cast("int32", width - base), span))
            loaded = tirx.Select(inside, masked_load(f"float32x{span}", data, *indices, inside),
                                 tirx.Broadcast(tirx.const(fill, "float32"), span))
        for phase in range(min(stride_w, kernel_w - group * stride_w)):
            taps.append(loaded if stride_w == 1 else tirx.Shuffle(
                [loaded], [tirx.const(phase + stride_w * lane, "int32") for lane in range(lanes)]))
    return taps


class IndexExpressions:
    """Index expressions in a row kernel's own index type (`index_type`, the maps' dims' type),
    for the kernels built as statements: the pool's and direct_depthwise.py's."""

    index_type: str

    def _inside(self, index, extent):
        return tirx.And(index >= 0, index < extent)

    def _lanes(self, start, count: int):
        return tirx.Ramp(start, self._int(1), count)

    def _int(self, value: int):
        return tirx.const(value, self.index_type)


class _Pool(IndexExpressions):
    """The loop nest of one max pooling (one version of it: its loop variables are its own):
    planes, output rows, then the row's columns."""

    def __init__(self, data: tirx.Buffer, out: tirx.Buffer, kernel_h: int, kernel_w: int,
                 stride_h: int, stride_w: int, pad_top: int, pad_left: int, lanes: int):
        batch, channels, self.height, self.width = data.shape
        _, _, self.out_height, self.out_width = out.shape
        self.index_type = self.width.ty.dtype
        self.planes = batch * channels
        self.window = (kernel_h, kernel_w, stride_h, stride_w, pad_top, pad_left)
        self.lanes = lanes
        self.sources = (data, out)
        self.data, self.out = (
            tirx.decl_buffer((self.planes, *buffer.shape[2:]), buffer.dtype,
                             f"{buffer.name}_planes", data=buffer.data)
            for buffer in self.sources)
        self.plane = tirx.Var("plane", self.index_type)
        self.row = tirx.Var("out_row", self.index_type)

    def loop(self, parallel: bool) -> tirx.Stmt:
        kind = tirx.ForKind.PARALLEL if parallel else tirx.ForKind.SERIAL
        vector = tirx.decl_buffer((self.lanes,), "float32", "window_max", scope="global")
        scalar = tirx.decl_buffer((1,), "float32", "tap_max", scope="global")
        rows = tirx.For(self.row, self._int(0), self.out_height, tirx.ForKind.SERIAL,
                        tirx.SeqStmt(self._row(vector, scalar)))
        planes = tirx.For(self.plane, self._int(0), self.planes, kind, tirx.SeqStmt(
            [tirx.AllocBuffer(vector), tirx.AllocBuffer(scalar), rows]))
        views = [tirx.DeclBuffer(view, data=source.data)
                 for view, source in zip((self.data, self.out), self.sources)]
        return tirx.SeqStmt(views + [planes])

    def _row(self, vector: tirx.Buffer, scalar: tirx.Buffer) -> list[tirx.Stmt]:
        """One output row: the scalar columns on the left, the vectors, the rest: scalar columns
        after whole vectors, masked vectors in a row too narrow for one."""
        kernel_h, kernel_w, stride_h, stride_w, pad_top, pad_left = self.window
        lanes = self.lanes
        # the first column whose taps start inside the row, and the last vector start whose
        # widest load (tap group (kernel_w - 1) // stride, stride x lanes columns) ends inside it
        first = self._int(-(-pad_left // stride_w))
        widest_load = (kernel_w - 1) // stride_w * stride_w + stride_w * lanes
        last_start = tirx.min(tirx.floordiv(self.width + pad_left - widest_load, stride_w),
                              self.out_width - lanes)
        starts = last_start - first + 1
        vector_end = tirx.Select(starts >= 1, last_start + lanes, first)
        left_column = tirx.Var("left_column", self.index_type)
        right_column = tirx.Var("right_column", self.index_type)
        vector_index = tirx.Var("vector", self.index_type)
        return [
            tirx.For(left_column, self._int(0), tirx.min(first, self.out_width),
                     tirx.ForKind.SERIAL, self._scalar_output(left_column, scalar)),
            tirx.For(vector_index, self._int(0),
                     tirx.floordiv(tirx.max(starts + lanes - 1, 0), lanes), tirx.ForKind.SERIAL,
                     self._vector_output(first + vector_index * lanes, vector)),
            tirx.IfThenElse(tirx.And(starts >= 1, tirx.floormod(starts + lanes - 1, lanes) != 0),
                            self._vector_output(last_start, vector), None),
            # after whole vectors, the few columns left cost less one at a time than a masked
            # vector each (grouped_convnet's 3x3 pool at 1x3x96x96: +2.8% with masked vectors)
            tirx.IfThenElse(
                starts >= 1,
                tirx.For(right_column, vector_end, tirx.max(self.out_width - vector_end, 0),
                         tirx.ForKind.SERIAL, self._scalar_output(right_column, scalar)),
                self._masked_outputs(first, self.out_width, vector)),
        ]

    def _masked_outputs(self, begin, end, vector: tirx.Buffer) -> tirx.Stmt:
        """The outputs begin .. end - 1 of the row in vectors whose loads may leave the input
        row (a row too narrow for a whole vector): the lanes outside it load
        nothing and count as the lowest float, and only the lanes before `end` are stored."""
        lanes = self.lanes
        index = tirx.Var("masked_vector", self.index_type)
        start = begin + index * lanes
        return tirx.For(index, self._int(0),
                        tirx.floordiv(tirx.max(end - begin, 0) + lanes - 1, lanes),
                        tirx.ForKind.SERIAL, self._vector_output(start, vector, end - start))

    def _vector_output(self, start, vector: tirx.Buffer, count=None) -> tirx.Stmt:
        """The outputs start .. start + lanes - 1 of the row, whose loads stay in the input;
        with `count`, the first `count` of them, whose loads may leave it."""
        kernel_h, kernel_w, stride_h, stride_w, pad_top, pad_left = self.window
        lanes = self.lanes
        whole = self._lanes(self._int(0), lanes)
        tap_row = tirx.Var("tap_row", self.index_type)
        input_row = self.row * stride_h - pad_top + tap_row
        taps = row_taps(self.data, [self.plane, input_row], start, kernel_w, stride_w, pad_left,
                        lanes, None if count is None else LOWEST)
        peak = functools.reduce(tirx.max, taps, tirx.BufferLoad(vector, [whole]))
        out_indices = [self.plane, self.row, self._lanes(start, lanes)]
        result = tirx.BufferLoad(vector, [whole])
        store = (tirx.BufferStore(self.out, result, out_indices) if count is None else
                 tirx.Evaluate(masked_store(self.out, result, *out_indices,
                                            whole < tirx.Broadcast(count, lanes))))
        return tirx.SeqStmt([
            tirx.BufferStore(vector, tirx.Broadcast(tirx.const(LOWEST, "float32"), lanes),
                             [whole]),
            tirx.For(tap_row, self._int(0), self._int(kernel_h), tirx.ForKind.SERIAL,
                     tirx.IfThenElse(self._inside(input_row, self.height),
                                     tirx.BufferStore(vector, peak, [whole]), None)),
            store,
        ])

    def _scalar_output(self, column, scalar: tirx.Buffer) -> tirx.Stmt:
        kernel_h, kernel_w, stride_h, stride_w, pad_top, pad_left = self.window
        zero = [self._int(0)]
        tap_row = tirx.Var("tap_row", self.index_type)
        tap_column = tirx.Var("tap_column", self.index_type)
        input_row = self.row * stride_h - pad_top + tap_row
        input_column = column * stride_w - pad_left + tap_column
        value = tirx.BufferLoad(self.data, [self.plane, input_row, input_column])
        inside = tirx.And(self._inside(input_row, self.height),
                          self._inside(input_column, self.width))
        update = tirx.IfThenElse(inside, tirx.BufferStore(
            scalar, tirx.max(tirx.BufferLoad(scalar, zero), value), zero), None)
        taps = tirx.For(tap_row, self._int(0), self._int(kernel_h), tirx.ForKind.SERIAL,
                        tirx.For(tap_column, self._int(0), self._int(kernel_w),
                                 tirx.ForKind.SERIAL, update))
        return tirx.SeqStmt([
            tirx.BufferStore(scalar, tirx.const(LOWEST, "float32"), zero),
            taps,
            tirx.BufferStore(self.out, tirx.BufferLoad(scalar, zero),
                             [self.plane, self.row, column]),
        ])
