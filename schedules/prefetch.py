"""Software prefetch of a conv's input and weights, channels ahead of the reduction.

A pointwise conv over NCHW reads, for each input channel, one tile's run of pixels: a line or
two, a whole channel plane (H x W floats) past the last. Inside a model that input is never
where the kernel alone finds it: the kernel before it (a depthwise conv, split over channels)
has just written half of it on the other core. Measured on MobileNetV2's 576 -> 96 projection
at 14x14, two threads: 84 us with its input in both cores' caches, 160 us with it in L3 only,
195-210 us right after the depthwise conv that writes it. The CPU's own prefetchers do not
hide that walk; asking for the lines a few dozen channels ahead does (182 -> 98 us in the
model's run).

The packed weights stream from beyond L2 in every run of a model whose weights outgrow it
(MobileNetV2's 14 MB): each step of the reduction reads one row of the tile's weight panel, a
line or two, the next step the next row, and the CPU's prefetchers left the kernels waiting on
them. Asked for 32 channels ahead too (the last steps of a panel ask for the next panel's first
rows), MobileNetV2's layers in a run (profiler, 3 rounds in each order) took: 160 -> 960 at
7x7 -18%, 960 -> 160, 960 -> 320 and 576 -> 160 -8 to -10%, 320 -> 1280 -8%, 64 -> 384 and
96 -> 576 at 14x14 -4 to -7%. A direct conv's panel row is asked for the same way, channels
ahead within its (kernel row, kernel column) step: ResNet-18's 3x3 convs over 256 and 512
channels stream 1.2-9.4 MB each; the whole model in one process, 10 rounds in turns, each
order once, 7.64 / 7.33 -> 7.37 / 7.16 ms at 1x3x128x128 and 9.69 / 9.14 -> 9.16 / 8.80 ms at
2x3x96x112 (on a slow stretch of the host). Where it did not pay, nothing is prefetched: the
dense kernels' weights (MobileNetV2's classifier, BERT-mini's layers) ran within the noise
(-4 to +1%), Winograd's batched GEMMs 1-4% slower.

`prefetch_channels_ahead` asks for the tile's pixels (or its weight panel's row) of channel
c + PREFETCH_CHANNELS_AHEAD at the top of the reduction loop's step for channel c. A prefetch
never faults, so the steps near the last channel may ask for lines past it.
"""

from __future__ import annotations

import itertools

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from .row_chunks import substitute
from .tail_tiles import rewrite_loop_nest

# Channels ahead: each step is one tile's multiply-adds (7-14 FMAs, a few ns), and a line
# from the other core takes a few hundred. MobileNetV2, 1x3x224x224 and 2x3x160x128, in one
# process against no prefetch (4.01 and 3.63 ms): 8 -> 3.77 / 3.45 ms, 16 -> 3.73 / 3.41,
# 32 -> 3.62 / 3.42, 64 -> 3.76 / 3.44.
PREFETCH_CHANNELS_AHEAD = 32
# Shorter reductions lose more to the prefetches (two instructions and an address per step)
# than they gain: in MobileNetV2's run the layers over 16-192 channels took 5-20% longer
# (64 -> 384 at 14x14: 41 -> 46 us; 192 -> 32 at 28x28: 42 -> 48 us), those over 320 the same
# or less (576 -> 96 at 14x14: 182 -> 98 us; 384 -> 96: 90 -> 64 us; 960 -> 320 at 7x7:
# 189 -> 166 us).
PREFETCH_MIN_CHANNELS = 256
# Packed weights from this size are prefetched: a small model's weights stay in L2 from one run
# to the next, where a prefetch is two instructions a step for nothing. MobileNetV2 in one
# process, 20 rounds in turns, against no weight prefetch (4.89 and 3.51 ms, on a slow stretch
# of the host): prefetching every pointwise conv's weights 4.76 / 3.44 ms, from 64 KiB 4.75 /
# 3.40 ms, at 1x3x224x224 and 2x3x160x128. The small zoo CNNs (mobilenet_v2_style,
# grouped_convnet) ran within that stretch's noise (+-10%) either way.
PREFETCH_MIN_WEIGHT_BYTES = 64 << 10
CACHE_LINE_BYTES = 64  # x86-64's and the Cortex-A cores'


def prefetch_channels_ahead(func: tirx.PrimFunc, block_name: str, channel_var: tirx.Var,
                            buffer_name: str) -> tirx.PrimFunc:
    """`func` with prefetches, PREFETCH_CHANNELS_AHEAD steps ahead of the reduction loop over
    `channel_var`, of block `block_name`'s read of `buffer_name` in that step: the element
    its inner loops read at their first and last iterations (and at each mix of the two),
    which covers the lines of a tile's run of pixels, less those on a line already asked for
    (`_one_address_per_line`)."""

    def add_prefetches(loop: tirx.For):
        if not loop.loop_var.same_as(channel_var):
            return None
        inner_loops = []
        realize = _block_realize(loop.body, block_name, inner_loops)
        if realize is None:
            return None
        region = next(region for region in realize.block.reads
                      if region.source.name == buffer_name)
        bindings = {iter_var.var: value for iter_var, value
                    in zip(realize.block.iter_vars, realize.iter_values)}
        addresses = []
        for ends in itertools.product(*[(inner.min, inner.min + inner.extent - 1)
                                        for inner in inner_loops]):
            loop_values = {inner.loop_var: end for inner, end in zip(inner_loops, ends)}
            indices = [_ahead(substitute(substitute(dim.min, bindings), loop_values),
                              channel_var) for dim in region.region]
            if not any(tvm_ffi.structural_equal(indices, seen) for seen in addresses):
                addresses.append(indices)
        prefetches = [_prefetch(region.source, indices)
                      for indices in _one_address_per_line(region.source, addresses)]
        return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind,
                        tirx.SeqStmt([*prefetches, loop.body]), loop.thread_binding,
                        loop.annotations)

    return func.with_body(rewrite_loop_nest(func.body, lambda realize: realize, add_prefetches))


def _one_address_per_line(buffer: tirx.Buffer, addresses: list) -> list:
    """Of `addresses` (index lists into `buffer`), the fewest whose prefetches still bring in
    every line the others lie on: addresses within CACHE_LINE_BYTES of a run's first lie on its
    line or the next, so that run needs its first and its last address only, and its first
    alone where the first starts a line, counting from the buffer's start (TVM allocates
    buffers on a line and the weight file aligns its blobs to pages; an input the caller
    passes unaligned misses a line's prefetch, no more). A tile's 16 weights of a panel row,
    asked for at each vector's first and last lane, are one line: 4 prefetches -> 1.
    Addresses whose distance is not a constant are all kept."""
    analyzer = tvm.sym.Analyzer()
    offsets = [buffer.offset_of(indices)[0] for indices in addresses]
    distances = [analyzer.simplify(offset - offsets[0]) for offset in offsets]
    if not all(isinstance(distance, tirx.IntImm) for distance in distances):
        return addresses
    line = CACHE_LINE_BYTES * 8 // tvm.runtime.DataType(str(buffer.dtype)).bits
    order = sorted(range(len(addresses)), key=lambda i: distances[i].value)
    runs: list[list[int]] = []
    for i in order:
        if runs and distances[i].value - distances[runs[-1][0]].value < line:
            runs[-1].append(i)
        else:
            runs.append([i])
    kept = []
    for run in runs:
        first, last = run[0], run[-1]
        start = analyzer.modular_set(offsets[first])
        starts_a_line = start.coeff % line == 0 and start.base % line == 0
        kept += [first] if starts_a_line or first == last else [first, last]
    return [addresses[i] for i in kept]


def _block_realize(stmt, block_name: str, loops: list):
    """The realize of `block_name` under `stmt`, with the loops on the way appended to `loops`."""
    if isinstance(stmt, tirx.For):
        loops.append(stmt)
        return _block_realize(stmt.body, block_name, loops)
    if isinstance(stmt, tirx.SeqStmt):
        for child in stmt.seq:
            found = _block_realize(child, block_name, loops)
            if found is not None:
                return found
        return None
    if isinstance(stmt, s_tir.SBlockRealize) and stmt.block.name_hint == block_name:
        return stmt
    return None


def _ahead(index, channel_var: tirx.Var):
    """`index` at channel `channel_var` + PREFETCH_CHANNELS_AHEAD (an analyzer cannot bind a
    variable to an expression of itself, hence the detour through a fresh variable)."""
    later = tirx.Var("later_channel", channel_var.ty.dtype)
    return substitute(substitute(index, {channel_var: later}),
                       {later: channel_var + PREFETCH_CHANNELS_AHEAD})


def _prefetch(buffer: tirx.Buffer, indices: list) -> tirx.Evaluate:
    read, keep_in_all_levels, data_cache = (tirx.const(v, "int32") for v in (0, 3, 1))
    address = tirx.address_of(tirx.BufferLoad(buffer, indices))
    return tirx.Evaluate(tirx.call_llvm_intrin("void", "llvm.prefetch", address, read,
                                               keep_in_all_levels, data_cache))
