"""Depthwise convs read straight from the input (issue 5: several versions per hot op, for
small and large spatial extents; SoD2 §4.4.2's multi-version code).

The packed depthwise kernel (conv2d.py) first copies each channel padded and split into column
phases, then sums vectors of the copy in tiles of 4 rows x a vector of columns. On maps of at
most a vector's width the copy costs as much as the sums, most lanes of each vector are
padding, and the tiles' rows past the map's end are computed too: MobileNetV2's depthwise layers
at 2x3x160x128 (maps down to 5x4) took 574 us in a run where onnxruntime's took 375 us (576
channels from 10x8 to 5x4 at stride 2: 64 against 9 us; 960 channels at 5x4: 29 against 12).
On wide maps at unit stride the copy is a pass over each plane that direct loads do without.
Three direct kernels, each a run-time version beside the packed kernel's:

- Strided convs, output rows of at most a vector (`_DirectDepthwise`): each output row is
  built as the max pool kernel (pool_kernels.py) builds its rows, with multiply-adds in place
  of maxima. For a vector of L output columns starting at `ow`, tap (ry, rx) reads input row
  oh * stride - pad + ry at columns ow * stride - pad + rx + stride * l (l < L); taps
  q * stride + r share one load of stride * L contiguous columns and take lanes r, r + stride,
  ... of it by a shuffle. The row's vectors start at column 0: those whose loads stay inside
  the input row load plainly, the others (the left padding, the right edge, a row narrower
  than a vector) load with a mask, the lanes outside the row reading nothing and counting zero
  (the padding), and store only the columns inside the output row. Tap rows outside the input
  are skipped with a check per row.
- Unit-stride convs that keep the map's size, planes narrower than a vector (`_FlatPlane`):
  vectors run over the plane's pixels flattened row after row (below).
- Outputs of a vector's width or more and DIRECT_TILE_ROWS rows or more, at any stride
  (`_DirectRowTiles`): tiles of DIRECT_TILE_ROWS output rows x a vector of columns read
  straight from the input, as the packed kernel's 4-row tiles read its copy. Without the copy,
  twice the rows fit the registers (the packed tile holds its shared input rows there too);
  at a stride, each input row's loads and shuffles serve every output row that reads it.

All three apply the fused epilogue (bias, ReLU6) to the sums lane by lane in a vectorized loop,
as the packed kernel's write-back applies it, and are used where that epilogue reads, besides
the sums, only values that do not change along a row (the flat kernel: along the plane), with
dilation 1, for ISAs whose masked loads and stores are fast (isa.VectorISA.fast_masks: AVX-512;
NEON moves masked lanes one by one, and AMD Zen's AVX2 masked store is slow: on such a host, 2
threads, MobileNetV2's depthwise layers alone at 2x3x160x128, the direct kernels ran 960 x 5x4
15% faster but 576 x 10x8 -> 5x4 at stride 2, each of its 4-wide rows one masked store, 50%
slower, the 17 layers 1.3% faster in all; the row tiles, whose filter does not fit AVX2's 16
registers, do not apply there). Measured in one process, 2 threads, per layer alone at batch 2,
packed -> direct: 576 x 10x8 -> 5x4 36.5 -> 21.8 us, 192 x 20x16 -> 10x8 29.5 -> 15.4 us, 144 x
40x32 -> 20x16 38.4 -> 28.2 us; 960 x 5x4 21.7 -> 17.3 us, 384 x 10x8 15.5 -> 13.4 us, 576 x
10x8 and 960 x 7x7 unchanged. Wider strided rows, one at a time, lost to the packed kernel: at
stride 2 with two vectors a row (96 x 80x64 -> 40x32) direct took 77.3 us against 67.9, the
packed copy, made once per input row, costing less than three shuffles per tap row and output
vector. Whole MobileNetV2, variants in turns: 2269-2315 -> 2079-2085 us at 2x3x160x128,
1x3x224x224 within 1%. The row tiles, layers alone: DIRECT_TILE_ROWS. Whole models, in one
process, without and with them at unit stride (inside a run a layer reads what the kernel
before it wrote, often from the other core's cache, and gains less than alone):
mobilenet_v2_style 60.9 -> 53.7 us at 1x3x64x64 and 171.3 -> 149.6 us at 2x3x96x80, MobileNetV2
2119 -> 2090 us at 1x3x224x224 and 1872 -> 1860 us at 2x3x160x128, grouped_convnet 139.6 ->
136.1 and 150.9 -> 147.0 us; MobileNetV2 compiles in 27.1 s against 22.7 s. Then at stride 2 as
well: MobileNetV2 2138 -> 2129 and 1962 -> 1932 us, mobilenet_v2_style 60.1 -> 59.3 and 153.3
-> 149.3 us, compiling in 25.7 s against 23.3 s. Planes (image x channel) run in parallel above
the parallel threshold (dispatch.py).
"""

from __future__ import annotations

import functools

import tvm
from tvm import s_tir, tirx
from tvm.tirx.op import masked_load, masked_store

from .dispatch import nested_ifs, parallel_buckets
from .pool_kernels import IndexExpressions, row_taps
from .register_tile import STAGE_ANNOTATION
from .row_chunks import substitute
from .tail_tiles import shifted_tile_start, uses_any

# The flat kernel finds each lane's row as floor((p + 0.5) x (1 / W)) in float32: the true
# quotient lies at least 0.5 / W from an integer, and below 2^20 pixels a plane the rounding
# errors stay under a quarter of that. Taller planes keep the packed kernel.
FLAT_PLANE_MAX_PIXELS = 1 << 20
# Output rows of a row tile (`_DirectRowTiles`). Each input row's taps, loaded once per tile,
# feed every row of the tile that reads them: at unit stride (rows + 2) x 3 loads for 9 x rows
# multiply-adds of a 3x3 filter. One conv alone (bias and ReLU6 fused, 2 threads, one process,
# the variants taking turns), packed kernel / tiles of 4 / 6 / 8 / 12 rows, us: 64 x 2x48x40
# 29.4 / 24.5 / 21.7 / 21.8 / 21.9, 64 x 2x64x64 53.3 / 44.3 / 41.4 / 42.3 / 46.0, 144 x
# 2x40x32 42.6 / 30.9 / 28.5 / 27.9 / 32.6, 144 x 1x56x56 49.9 / 43.8 / 42.5 / 38.4 / 44.3;
# packed / 8 rows: 64 x 1x32x32 8.8 / 5.9, 32 x 1x112x112 47.9 / 37.6, 32 x 2x80x64 32.5 / 26.2;
# at stride 2, packed / 8 rows: 96 x 2x80x64 139.9 / 119.1, 96 x 1x112x112 90.2 / 84.8, 144 x
# 1x56x56 38.6 / 30.1, 144 x 1x35x50 28.3 / 21.1.
DIRECT_TILE_ROWS = 8


def direct_kernel(sch: s_tir.Schedule, tiles, out_block, window: list[int], lanes: int,
                  registers: int, work, min_parallel_work: int) -> tuple[object, tirx.Stmt] | None:
    """(where it runs, the body) of the direct kernels for the depthwise kernel function `sch`
    schedules (its tiles block `tiles`, the packing stage before it, the write-back `out_block`
    after it with the epilogue inlined), or None where none applies (see the module
    docstring): strided convs read rows of at most `lanes` output columns directly, unit-stride
    convs that keep the map's size take planes narrower than `lanes` flat, and outputs of at
    least `lanes` columns and DIRECT_TILE_ROWS rows run in row tiles where the ISA's
    `registers` hold a tile."""
    kernel_h, kernel_w, stride_h, stride_w, pad_top, pad_left, dilation_h, dilation_w = window
    if (dilation_h, dilation_w) != (1, 1):
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
    analyzer = tvm.sym.Analyzer()
    _, _, height, width = data.shape
    _, _, out_height, out_width = epilogue.out.shape
    kernels = []
    if stride_w >= 2:
        kernels.append((out_width <= lanes, _DirectDepthwise))
    elif (stride_h == 1 and epilogue.plane_invariant()
            and analyzer.can_prove_equal(out_height, height)
            and analyzer.can_prove_equal(out_width, width)):
        kernels.append((tirx.And(width < lanes, height * width < FLAT_PLANE_MAX_PIXELS),
                        _FlatPlane))
    # the tile's sums, an input row's loads and its taps, and the filter, all in registers
    loads = stride_w * -(-kernel_w // stride_w)
    if DIRECT_TILE_ROWS + loads + kernel_w + kernel_h * kernel_w <= registers:
        # where a version above also holds, it runs (nested_ifs: the first that holds)
        kernels.append((tirx.And(out_width >= lanes, out_height >= DIRECT_TILE_ROWS),
                        _DirectRowTiles))
    if not kernels:
        return None
    # a kernel object per version: each version's loop variables are its own
    versions = [(condition, nested_ifs([
        (parallel_condition, kernel(data, weight, epilogue, window, lanes).loop(parallel))
        for parallel, parallel_condition in parallel_buckets(work, min_parallel_work)]))
        for condition, kernel in kernels]
    runs = analyzer.simplify(functools.reduce(tirx.Or, [condition for condition, _ in versions]))
    # inside `runs`, the last kernel runs wherever the ones before it do not
    return runs, nested_ifs(versions[:-1] + [(None, versions[-1][1])])


class _Epilogue:
    """The write-back's store with its block's iterators: the output, and its value as an
    expression of the sum (a load of the tiles buffer) and of the iterators."""

    def __init__(self, store: tirx.BufferStore, iterators: list[tirx.Var], tiles: tirx.Buffer):
        self.out = store.buffer
        self.value = store.value
        self.iterators = iterators
        self.tiles = tiles

    def plane_invariant(self) -> bool:
        """Whether the value depends on the row and column only through the sum."""
        return not uses_any(_with_sum(self.value, self.tiles, tirx.FloatImm("float32", 0.0)),
                            self.iterators[2:])

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


class _DirectDepthwise(IndexExpressions):
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
        # image-major, as every conv kernel's parallel loop (conv2d.py's module docstring)
        self.plane = tirx.Var("n_c_plane", self.index_type)
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
        taps = row_taps(self.data, [self.image, self.channel, input_row], start, kernel_w,
                        stride_w, pad_left, lanes, None if count is None else 0.0)
        products = [tap * tirx.Broadcast(tirx.BufferLoad(self.weight, [
            self.channel, self._int(0), tap_row, self._int(tap_column)]), lanes)
                    for tap_column, tap in enumerate(taps)]
        summed = functools.reduce(lambda total, product: total + product, products,
                                  tirx.BufferLoad(sums, [whole]))
        return tirx.SeqStmt([
            tirx.BufferStore(sums, tirx.Broadcast(tirx.const(0, "float32"), lanes), [whole]),
            tirx.For(tap_row, self._int(0), self._int(kernel_h), tirx.ForKind.SERIAL,
                     tirx.IfThenElse(self._inside(input_row, self.height),
                                     tirx.BufferStore(sums, summed, [whole]), None)),
            self._write_back(self.row, start, lambda lane: tirx.BufferLoad(sums, [lane]),
                             values, count),
        ])

    def _write_back(self, row, start, summed_at, values: tirx.Buffer, count=None) -> tirx.Stmt:
        """Store the epilogue of the sums `summed_at(lane)` to the outputs start .. start +
        lanes - 1 of output row `row`; with `count`, the first `count` of them only."""
        lanes = self.lanes
        lane = tirx.Var("lane", self.index_type)
        value = self.epilogue.at(self.image, self.channel, row, start + lane, summed_at(lane))
        if count is None:
            return tirx.For(lane, self._int(0), self._int(lanes), tirx.ForKind.VECTORIZED,
                            tirx.BufferStore(self.out, value,
                                             [self.image, self.channel, row, start + lane]))
        return tirx.SeqStmt([
            tirx.For(lane, self._int(0), self._int(lanes), tirx.ForKind.VECTORIZED,
                     tirx.BufferStore(values, value, [lane])),
            tirx.Evaluate(masked_store(
                self.out, tirx.BufferLoad(values, [self._lanes(self._int(0), lanes)]),
                self.image, self.channel, row, self._lanes(start, lanes),
                tirx.Ramp(tirx.const(0, "int32"), tirx.const(1, "int32"), lanes)
                < tirx.Broadcast(tirx.Cast("int32", tirx.min(count, lanes)), lanes))),
        ])


class _FlatPlane(IndexExpressions):
    """The loop nest of one unit-stride depthwise conv over planes narrower than a vector, whose
    output is the size of its input (one version of it): planes, then vectors of the plane's
    pixels flattened row after row, whatever rows they span.

    With stride 1 and the map's own size, output pixel p = row x W + column reads tap (ry, rx)
    at flat input pixel p + (ry - pad_top) x W + (rx - pad_left): every tap of a vector of
    pixels is one contiguous (masked) load. A tap whose column leaves the row would read the
    neighbouring row's edge instead of the padding; a mask on the lanes' columns drops it (each
    lane's column is p mod W, computed in floats: x86 has no vector integer division). A tap
    row above or below the map falls outside the flat plane, and the load's mask drops it.
    Packed, a 5x4 map filled 8 rows of 16-lane tiles; flat, its 20 pixels fill two vectors."""

    def __init__(self, data: tirx.Buffer, weight: tirx.Buffer, epilogue: _Epilogue,
                 window: list[int], lanes: int):
        batch, channels, self.height, self.width = data.shape
        self.index_type = self.width.ty.dtype
        self.pixels = self.height * self.width
        self.data, self.out = (
            tirx.decl_buffer((batch * channels, self.pixels), buffer.dtype, f"{buffer.name}_flat",
                             data=buffer.data)
            for buffer in (data, epilogue.out))
        self.sources = (data, epilogue.out)
        self.planes = batch * channels
        self.channels = channels
        self.weight, self.epilogue = weight, epilogue
        self.kernel_h, self.kernel_w, _, _, self.pad_top, self.pad_left = window[:6]
        self.lanes = lanes
        # image-major, as every conv kernel's parallel loop (conv2d.py's module docstring)
        self.plane = tirx.Var("n_c_plane", self.index_type)

    def loop(self, parallel: bool) -> tirx.Stmt:
        kind = tirx.ForKind.PARALLEL if parallel else tirx.ForKind.SERIAL
        lanes = self.lanes
        sums = tirx.decl_buffer((lanes,), "float32", "depthwise_sums", scope="global")
        values = tirx.decl_buffer((lanes,), self.out.dtype, "depthwise_values", scope="global")
        vector = tirx.Var("pixel_vector", self.index_type)
        vectors = tirx.For(vector, self._int(0), tirx.floordiv(self.pixels + lanes - 1, lanes),
                           tirx.ForKind.SERIAL,
                           self._vector_output(vector * lanes, sums, values))
        planes = tirx.For(self.plane, self._int(0), self.planes, kind,
                          tirx.SeqStmt([tirx.AllocBuffer(sums), tirx.AllocBuffer(values),
                                        vectors]))
        views = [tirx.DeclBuffer(view, data=source.data)
                 for view, source in zip((self.data, self.out), self.sources)]
        return tirx.SeqStmt(views + [planes])

    def _vector_output(self, start, sums: tirx.Buffer, values: tirx.Buffer) -> tirx.Stmt:
        """The pixels start .. start + lanes - 1 of the plane (those inside it stored)."""
        lanes = self.lanes
        whole = self._lanes(self._int(0), lanes)
        offsets = tirx.Ramp(tirx.const(0, "int32"), tirx.const(1, "int32"), lanes)

        def lanes_of(value):
            return tirx.Broadcast(tirx.Cast("int32", value), lanes)

        def floats_of(value):
            return tirx.Broadcast(tirx.Cast("float32", value), lanes)

        # each lane's row and column, in floats (FLAT_PLANE_MAX_PIXELS); the
        # lane offsets converted apart from the start stay a constant vector
        pixels = tirx.Cast(f"float32x{lanes}", offsets) + floats_of(start)
        rows = tirx.floor((pixels + floats_of(tirx.const(0.5, "float32")))
                          * floats_of(tirx.const(1.0, "float32")
                                      / tirx.Cast("float32", self.width)))
        columns = tirx.Cast(f"int32x{lanes}", pixels - rows * floats_of(self.width))
        rows = tirx.Cast(f"int32x{lanes}", rows)
        tap_row = tirx.Var("tap_row", self.index_type)
        shift_row = tap_row - self.pad_top
        # the tap row inside the map (which also drops the lanes past the plane's end)
        row_inside = tirx.And(rows >= lanes_of(-shift_row),
                              rows < lanes_of(self.height - shift_row))
        channel = tirx.floormod(self.plane, self.channels)
        products = []
        for tap_column in range(self.kernel_w):
            shift = tap_column - self.pad_left
            inside = row_inside
            if shift < 0:
                inside = tirx.And(inside, columns >= lanes_of(self._int(-shift)))
            elif shift > 0:
                inside = tirx.And(inside, columns < lanes_of(self.width - shift))
            first = start + shift_row * self.width + shift
            loaded = tirx.Select(inside, masked_load(
                f"float32x{lanes}", self.data, self.plane, self._lanes(first, lanes), inside),
                tirx.Broadcast(tirx.const(0, "float32"), lanes))
            weight = tirx.BufferLoad(self.weight, [channel, self._int(0), tap_row,
                                                   self._int(tap_column)])
            products.append(loaded * tirx.Broadcast(weight, lanes))
        summed = functools.reduce(lambda total, product: total + product, products,
                                  tirx.BufferLoad(sums, [whole]))
        lane = tirx.Var("lane", self.index_type)
        value = self.epilogue.at(tirx.floordiv(self.plane, self.channels), channel,
                                 self._int(0), self._int(0), tirx.BufferLoad(sums, [lane]))
        return tirx.SeqStmt([
            tirx.BufferStore(sums, tirx.Broadcast(tirx.const(0, "float32"), lanes), [whole]),
            tirx.For(tap_row, self._int(0), self._int(self.kernel_h), tirx.ForKind.SERIAL,
                     tirx.BufferStore(sums, summed, [whole])),
            tirx.For(lane, self._int(0), self._int(lanes), tirx.ForKind.VECTORIZED,
                     tirx.BufferStore(values, value, [lane])),
            tirx.Evaluate(masked_store(self.out, tirx.BufferLoad(values, [whole]), self.plane,
                                       self._lanes(start, lanes),
                                       offsets < lanes_of(self.pixels - start))),
        ])



class _DirectRowTiles(_DirectDepthwise):
    """The loop nest of one depthwise conv whose output is at least a vector wide and
    DIRECT_TILE_ROWS high (one version of it): planes, tiles of DIRECT_TILE_ROWS output rows
    (the last one shifted back over the one before, its rows computed twice with the same
    values, as tail_tiles.py shifts tiles), then the rows' column vectors. A tile's input rows
    are read in turn, each row's taps loaded once (at a stride, shuffled out of its loads as
    `row_taps` does) and multiplied into the sums of every output row of the tile that reads
    it; an input row above or below the map is skipped. The filter's taps are copied per plane
    to a stack array, which LLVM keeps in registers across the plane's tiles.

    Every vector's loads and stores are masked to the row (the lanes outside it count zero,
    the padding): on AVX-512 a masked load costs what a plain one does, and one kind of vector
    keeps the code small. Split as `_DirectDepthwise._row` splits a row (masked ends, plain
    middle), the kernel's code was three times as large and no faster: MobileNetV2 compiled in
    34.3 s against 27.1 s (22.7 s without row tiles), and mobilenet_v2_style at 2x3x96x80 ran
    159.5 against 149.6 us."""

    def __init__(self, data: tirx.Buffer, weight: tirx.Buffer, epilogue: _Epilogue,
                 window: list[int], lanes: int):
        super().__init__(data, weight, epilogue, window, lanes)
        rows = self.rows = DIRECT_TILE_ROWS
        self.group = tirx.Var("row_group", self.index_type)
        self.row = shifted_tile_start(self.group * rows, self.out_height, rows)
        kernel_h, kernel_w = window[:2]
        self.taps = tirx.decl_buffer((kernel_h * kernel_w,), "float32", "depthwise_taps",
                                     scope="global")

    def loop(self, parallel: bool) -> tirx.Stmt:
        kind = tirx.ForKind.PARALLEL if parallel else tirx.ForKind.SERIAL
        kernel_h, kernel_w = self.window[:2]
        sums = tirx.decl_buffer((self.rows, self.lanes), "float32", "depthwise_sums",
                                scope="global")
        values = tirx.decl_buffer((self.lanes,), self.out.dtype, "depthwise_values",
                                  scope="global")
        copy_taps = [tirx.BufferStore(self.taps, tirx.BufferLoad(self.weight, [
            self.channel, self._int(0), self._int(ry), self._int(rx)]), [ry * kernel_w + rx])
                     for ry in range(kernel_h) for rx in range(kernel_w)]
        groups = tirx.floordiv(self.out_height + self.rows - 1, self.rows)
        tiles = tirx.For(self.group, self._int(0), groups, tirx.ForKind.SERIAL,
                         self._row(sums, values))
        return tirx.For(self.plane, self._int(0), self.batch * self.channels, kind,
                        tirx.SeqStmt([tirx.AllocBuffer(sums), tirx.AllocBuffer(values),
                                      tirx.AllocBuffer(self.taps), *copy_taps, tiles]))

    def _row(self, sums: tirx.Buffer, values: tirx.Buffer) -> tirx.Stmt:
        """The tile's column vectors, every one masked (`_vector_output` with a count)."""
        vectors = tirx.floordiv(self.out_width + self.lanes - 1, self.lanes)
        return self._vectors(self._int(0), vectors, sums, values, masked=True)

    def _vector_output(self, start, sums: tirx.Buffer, values: tirx.Buffer,
                       count=None) -> tirx.Stmt:
        """The outputs start .. start + lanes - 1 (the first `count` of them stored) of each
        output row of the tile."""
        kernel_h, kernel_w, stride_h, stride_w, pad_top, pad_left = self.window
        lanes, rows = self.lanes, self.rows
        whole = self._lanes(self._int(0), lanes)
        body = [tirx.BufferStore(sums, tirx.Broadcast(tirx.const(0, "float32"), lanes),
                                 [self._int(row), whole]) for row in range(rows)]
        for input_offset in range((rows - 1) * stride_h + kernel_h):
            input_row = self.row * stride_h - pad_top + input_offset
            loaded = row_taps(self.data, [self.image, self.channel, input_row], start, kernel_w,
                              stride_w, pad_left, lanes, 0.0)
            tap_vars = [tirx.Var(f"tap{rx}", f"float32x{lanes}") for rx in range(kernel_w)]
            updates = []
            for row in range(rows):
                tap_row = input_offset - row * stride_h
                if not 0 <= tap_row < kernel_h:
                    continue
                products = [tap * tirx.Broadcast(tirx.BufferLoad(
                    self.taps, [self._int(tap_row * kernel_w + rx)]), lanes)
                            for rx, tap in enumerate(tap_vars)]
                updates.append(tirx.BufferStore(sums, functools.reduce(
                    lambda total, product: total + product, products,
                    tirx.BufferLoad(sums, [self._int(row), whole])), [self._int(row), whole]))
            if not updates:  # a row between two strided output rows' windows: none reads it
                continue
            body.append(tirx.IfThenElse(
                self._inside(input_row, self.height),
                tirx.SeqStmt([tirx.Bind(var, value) for var, value in zip(tap_vars, loaded)]
                             + updates), None))
        for row in range(rows):
            body.append(self._write_back(
                self.row + row, start,
                lambda lane, row=row: tirx.BufferLoad(sums, [self._int(row), lane]),
                values, count))
        return tirx.SeqStmt(body)
