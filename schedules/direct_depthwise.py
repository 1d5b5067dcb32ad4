"""Narrow output rows of strided depthwise convs, read straight from the input a vector of
output columns at a time (issue 5: several versions per hot op, for small and large spatial
extents; SoD2 §4.4.2's multi-version code).

The packed depthwise kernel (conv2d.py) first copies each channel padded and split into column
phases, then sums vectors of the copy in tiles of 4 rows x a vector of columns. On rows of at
most a vector the copy costs as much as the sums, and the tiles' rows past the map's end are
computed too: MobileNetV2's stride-2 depthwise layers at 2x3x160x128 took 215 us in a run
where onnxruntime's took 92 us (576 channels from 10x8 to 5x4: 64 against 9 us).

Here each output row is built as the max pool kernel (pool_kernels.py) builds its rows, with
multiply-adds in place of maxima: for a vector of L output columns starting at `ow`, tap
(ry, rx) reads input row oh * stride - pad + ry at columns ow * stride - pad + rx + stride * l
(l < L). Taps q * stride + r share one load of stride * L contiguous columns and take lanes r,
r + stride, ... of it by a shuffle. The row's vectors start at column 0: those whose loads
stay inside the input row load plainly, the others (the left padding, the right edge, a row
narrower than a vector) load with a mask, the lanes outside the row reading nothing and
counting zero (the padding), and store only the columns inside the output row. Tap rows outside
the input are skipped with a check per row. The fused epilogue (bias, ReLU6) is applied to the
sums lane by lane in a vectorized loop, as the packed kernel's write-back applies it.

Where: depthwise convs of stride 2 or more and dilation 1 whose epilogue reads, besides the
sums, only values that do not change along a row (a bias per channel, constants), on output
rows of at most one vector (a run-time `if` on the width; wider rows keep the packed kernel),
for ISAs whose masked loads are fast (isa.VectorISA.fast_masks: AVX-512).
Measured in one process, 2 threads: per layer alone, packed -> direct, 576 x 10x8 -> 5x4
36.5 -> 21.8 us, 192 x 20x16 -> 10x8 29.5 -> 15.4 us, 144 x 40x32 -> 20x16 38.4 -> 28.2 us;
but 96 x 80x64 -> 40x32 (two vectors a row) 67.9 -> 77.3 us, where the packed copy, made
once per input row, costs less than the direct kernel's three shuffles per tap row and output
vector; and at stride 1 the packed tiles share each input row's loads among 4 output rows
(384 x 10x8 15.5 -> 19.0 us direct). Whole MobileNetV2, variants in turns: 2192 -> 2097 us
at 2x3x160x128, 2322 -> 2264 us at 1x3x224x224.
Planes (image x channel) run in parallel above the parallel threshold (dispatch.py).
"""

from __future__ import annotations

import functools

import tvm
from tvm import s_tir, tirx
from tvm.tirx.op import masked_load, masked_store

from .dispatch import nested_ifs, parallel_buckets
from .register_tile import STAGE_ANNOTATION
from .row_chunks import substitute
from .tail_tiles import uses_any

# The smallest column stride read directly; at stride 1 the packed kernel's tiles of 4 rows
# share their input rows' loads, which a row at a time does not.
MIN_DIRECT_STRIDE = 2


def narrow_row_kernel(sch: s_tir.Schedule, tiles, out_block, window: list[int], lanes: int,
                      work, min_parallel_work: int) -> tuple[object, tirx.Stmt] | None:
    """(where it runs: output rows of at most `lanes` columns, the direct kernel's body) for the
    depthwise kernel function `sch` schedules (its tiles block `tiles`, the packing stage before
    it, the write-back `out_block` after it with the epilogue inlined), or None where it does not
    apply (see the module docstring)."""
    kernel_h, kernel_w, stride_h, stride_w, pad_top, pad_left, dilation_h, dilation_w = window
    if stride_w < MIN_DIRECT_STRIDE or (dilation_h, dilation_w) != (1, 1):
        return None
    packing = [block for block in sch.get_producers(tiles)
               if STAGE_ANNOTATION in sch.get(block).annotations]
    if len(packing) != 1:
        return None
    data = sch.get(packing[0]).reads[0].source
    packed, tiles_buffer = sch.get(packing[0]).writes[0].source, sch.get(tiles).writes[0].source
    weight, = (region.source for region in sch.get(tiles).reads
               if not region.source.same_as(packed) and not region.source.same_as(tiles_buffer))
    func = sch.mod["main"]
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    params = [param for param in func.params if hasattr(param, "shape")]
    if (len(blocks) != 3 or not any(sch.get(out_block).writes[0].source.same_as(param)
                                    for param in params)
            or not any(data.same_as(param) for param in params)):
        return None
    epilogue = _row_invariant_epilogue(sch.get(out_block), tiles_buffer)
    if epilogue is None:
        return None
    kernel = _DirectDepthwise(data, weight, epilogue, window, lanes)
    versions = [(condition, kernel.loop(parallel))
                for parallel, condition in parallel_buckets(work, min_parallel_work)]
    narrow = tvm.sym.Analyzer().simplify(kernel.out_width <= lanes)
    return narrow, nested_ifs(versions)


class _Epilogue:
    """The write-back's store with its block's iterators: the output, and its value as an
    expression of the sum (a load of the tiles buffer) and of the iterators."""

    def __init__(self, store: tirx.BufferStore, iterators: list[tirx.Var], tiles: tirx.Buffer):
        self.out = store.buffer
        self.value = store.value
        self.iterators = iterators
        self.tiles = tiles

    def at(self, image, channel, row, column, summed) -> tirx.PrimExpr:
        """The value stored at (image, channel, row, column) for the sum `summed` there."""
        value = _with_sum(self.value, self.tiles, summed)
        return substitute(value, dict(zip(self.iterators, [image, channel, row, column])))


def _row_invariant_epilogue(block: s_tir.SBlock, tiles: tirx.Buffer) -> _Epilogue | None:
    """The write-back as an `_Epilogue`, if it is one store at the block's own (n, c, h, w)
    whose value reads the sum there and otherwise only what does not change along w, built of
    nodes `_with_sum` rebuilds."""
    store = block.body
    if not isinstance(store, tirx.BufferStore) or len(block.iter_vars) != 4:
        return None
    iterators = [iv.var for iv in block.iter_vars]
    if not all(index.same_as(var) for index, var in zip(store.indices, iterators)):
        return None
    loads = []
    if _with_sum(store.value, tiles, tirx.FloatImm("float32", 0.0), loads) is None:
        return None
    sums = [load for load in loads if load.source.same_as(tiles)]
    others = [load for load in loads if not load.source.same_as(tiles)]
    if len(sums) != 1 or not all(index.same_as(var)
                                 for index, var in zip(sums[0].indices, iterators)):
        return None
    if any(uses_any(index, [iterators[3]]) for load in others for index in load.indices):
        return None
    return _Epilogue(store, iterators, tiles)


_BINARY_OPS = (tirx.Add, tirx.Sub, tirx.Mul, tirx.Div, tirx.Min, tirx.Max, tirx.FloorDiv,
               tirx.FloorMod, tirx.LT, tirx.LE, tirx.GT, tirx.GE, tirx.EQ, tirx.NE, tirx.And,
               tirx.Or)


def _with_sum(expr, tiles: tirx.Buffer, summed, loads: list | None = None):
    """`expr` with its loads of `tiles` replaced by `summed` (each load met appended to
    `loads`); None where it holds a kind of node this does not rebuild (TVM 0.27 has no Python
    expression mutator)."""
    def rebuild(node):
        if isinstance(node, tvm.ir.expr.TensorLoad):
            if loads is not None:
                loads.append(node)
            return summed if node.source.same_as(tiles) else node
        if isinstance(node, (tirx.IntImm, tirx.FloatImm, tirx.Var)):
            return node
        if isinstance(node, _BINARY_OPS):
            a, b = rebuild(node.a), rebuild(node.b)
            return None if a is None or b is None else type(node)(a, b)
        if isinstance(node, tirx.Select):
            parts = [rebuild(part)
                     for part in (node.condition, node.true_value, node.false_value)]
            return None if any(part is None for part in parts) else tirx.Select(*parts)
        if isinstance(node, tirx.Cast):
            value = rebuild(node.value)
            return None if value is None else tirx.Cast(node.ty, value)
        if isinstance(node, tvm.ir.expr.Call):
            args = [rebuild(arg) for arg in node.args]
            return (None if any(arg is None for arg in args)
                    else tirx.call_intrin(node.ty, node.op, *args))
        return None

    return rebuild(expr)


class _DirectDepthwise:
    """The loop nest of one direct depthwise conv (one version of it): planes, output rows,
    then the row's column vectors."""

    def __init__(self, data: tirx.Buffer, weight: tirx.Buffer, epilogue: _Epilogue,
                 window: list[int], lanes: int):
        self.batch, self.channels, self.height, self.width = data.shape
        self.out = epilogue.out
        _, _, self.out_height, self.out_width = self.out.shape
        self.index_type = self.width.ty.dtype
        self.data, self.weight, self.epilogue = data, weight, epilogue
        self.window = window[:6]
        self.lanes = lanes
        self.plane = tirx.Var("plane", self.index_type)
        self.image = tirx.floordiv(self.plane, self.channels)
        self.channel = tirx.floormod(self.plane, self.channels)
        self.row = tirx.Var("out_row", self.index_type)

    def loop(self, parallel: bool) -> tirx.Stmt:
        kind = tirx.ForKind.PARALLEL if parallel else tirx.ForKind.SERIAL
        sums = tirx.decl_buffer((self.lanes,), "float32", "depthwise_sums", scope="global")
        values = tirx.decl_buffer((self.lanes,), self.out.dtype, "depthwise_values",
                                  scope="global")
        rows = tirx.For(self.row, self._int(0), self.out_height, tirx.ForKind.SERIAL,
                        self._row(sums, values))
        return tirx.For(self.plane, self._int(0), self.batch * self.channels, kind,
                        tirx.SeqStmt([tirx.AllocBuffer(sums), tirx.AllocBuffer(values), rows]))

    def _row(self, sums: tirx.Buffer, values: tirx.Buffer) -> tirx.Stmt:
        """One output row in vectors of columns from column 0: masked ones where the vector's
        loads start left of the input row (its left padding), plain ones while they stay inside
        it and the vector inside the output row, masked ones for the rest. No vector is shifted
        back over another as in the packed kernel: its outputs would be computed twice, and a
        masked vector costs no more than a plain one here (AVX-512's masked loads)."""
        kernel_h, kernel_w, stride_h, stride_w, pad_top, pad_left = self.window
        lanes = self.lanes
        vectors = tirx.floordiv(self.out_width + lanes - 1, lanes)
        # the first vector whose loads start inside the row, and the last one whose widest load
        # (tap group (kernel_w - 1) // stride, stride x lanes columns) ends inside it
        widest_load = (kernel_w - 1) // stride_w * stride_w + stride_w * lanes
        first_plain = tirx.min(self._int(-(-pad_left // (stride_w * lanes))), vectors)
        last_plain = tirx.min(
            tirx.floordiv(self.width + pad_left - widest_load, stride_w * lanes),
            tirx.floordiv(self.out_width, lanes) - 1)
        plain_end = tirx.max(last_plain + 1, first_plain)
        return tirx.SeqStmt([
            self._vectors(self._int(0), first_plain, sums, values, masked=True),
            self._vectors(first_plain, plain_end, sums, values, masked=False),
            self._vectors(plain_end, vectors, sums, values, masked=True),
        ])

    def _vectors(self, begin, end, sums: tirx.Buffer, values: tirx.Buffer,
                 masked: bool) -> tirx.Stmt:
        """The row's column vectors begin .. end - 1. Masked ones load only the lanes inside
        the input row (the others count zero, the padding) and store only the columns inside
        the output row."""
        lanes = self.lanes
        index = tirx.Var("masked_vector" if masked else "vector", self.index_type)
        start = (begin + index) * lanes
        count = self.out_width - start if masked else None
        return tirx.For(index, self._int(0), tirx.max(end - begin, 0), tirx.ForKind.SERIAL,
                        self._vector_output(start, sums, values, count))

    def _vector_output(self, start, sums: tirx.Buffer, values: tirx.Buffer,
                       count=None) -> tirx.Stmt:
        """The outputs start .. start + lanes - 1 of the row, whose loads stay in the input;
        with `count`, the first `count` of them, whose loads may leave it."""
        kernel_h, kernel_w, stride_h, stride_w, pad_top, pad_left = self.window
        lanes = self.lanes
        whole = self._lanes(self._int(0), lanes)
        tap_row = tirx.Var("tap_row", self.index_type)
        input_row = self.row * stride_h - pad_top + tap_row
        products = []
        for group in range(-(-kernel_w // stride_w)):
            base = start * stride_w - pad_left + group * stride_w
            indices = [self.image, self.channel, input_row,
                       self._lanes(base, stride_w * lanes)]
            if count is None:
                loaded = tirx.BufferLoad(self.data, indices)
            else:
                # in 32-bit lanes: 64-bit ones took four compares per 32-lane mask
                offsets = tirx.Ramp(tirx.const(0, "int32"), tirx.const(1, "int32"),
                                    stride_w * lanes)
                inside = tirx.And(
                    offsets >= tirx.Broadcast(tirx.Cast("int32", -base), stride_w * lanes),
                    offsets < tirx.Broadcast(tirx.Cast("int32", self.width - base),
                                             stride_w * lanes))
                loaded = tirx.Select(
                    inside, masked_load(f"float32x{stride_w * lanes}", self.data, *indices,
                                        inside),
                    tirx.Broadcast(tirx.const(0, "float32"), stride_w * lanes))
            for phase in range(min(stride_w, kernel_w - group * stride_w)):
                tap = tirx.Shuffle([loaded], [tirx.const(phase + stride_w * lane, "int32")
                                              for lane in range(lanes)])
                weight = tirx.BufferLoad(self.weight, [self.channel, self._int(0), tap_row,
                                                       self._int(group * stride_w + phase)])
                products.append(tap * tirx.Broadcast(weight, lanes))
        summed = functools.reduce(lambda total, product: total + product, products,
                                  tirx.BufferLoad(sums, [whole]))
        lane = tirx.Var("lane", self.index_type)
        value = self.epilogue.at(self.image, self.channel, self.row, start + lane,
                                 tirx.BufferLoad(sums, [lane]))
        out_lanes = [self.image, self.channel, self.row, self._lanes(start, lanes)]
        if count is None:
            write_back = tirx.For(lane, self._int(0), self._int(lanes), tirx.ForKind.VECTORIZED,
                                  tirx.BufferStore(self.out, value,
                                                   [self.image, self.channel, self.row,
                                                    start + lane]))
        else:
            write_back = tirx.SeqStmt([
                tirx.For(lane, self._int(0), self._int(lanes), tirx.ForKind.VECTORIZED,
                         tirx.BufferStore(values, value, [lane])),
                tirx.Evaluate(masked_store(
                    self.out, tirx.BufferLoad(values, [whole]), *out_lanes,
                    tirx.Ramp(tirx.const(0, "int32"), tirx.const(1, "int32"), lanes)
                    < tirx.Broadcast(tirx.Cast("int32", tirx.min(count, lanes)), lanes))),
            ])
        return tirx.SeqStmt([
            tirx.BufferStore(sums, tirx.Broadcast(tirx.const(0, "float32"), lanes), [whole]),
            tirx.For(tap_row, self._int(0), self._int(kernel_h), tirx.ForKind.SERIAL,
                     tirx.IfThenElse(self._inside(input_row, self.height),
                                     tirx.BufferStore(sums, summed, [whole]), None)),
            write_back,
        ])

    def _inside(self, index, extent):
        return tirx.And(index >= 0, index < extent)

    def _lanes(self, start, count: int):
        return tirx.Ramp(start, self._int(1), count)

    def _int(self, value: int):
        return tirx.const(value, self.index_type)
