"""Shape buckets and run-time dispatch between kernel versions inside one PrimFunc.

SoD2 §4.4.2 ("multi-version code for hot operators": fat, regular and skinny matrices) and
MLC-LLM's low-batch GEMV specialization. A kernel whose row extent M is symbolic is scheduled
once per bucket, and the versions are joined by `if` on M at the top of one PrimFunc, so the
Relax graph, fusion and memory planning see a single kernel.

Buckets, on M = the extent the register tile runs along (a GEMM's rows: batch x sequence for a
transformer's linear layers, 1 in a decoder step; a conv's output width; a depthwise conv's
output width in vectors):
- M >= rows: ROW_TILES, tiles of `rows` rows (the last one shifted back); regular and fat
  GEMMs, large spatial convs. A fat GEMM with a large weight runs its column panels outermost
  (register_tile.py), so that each panel is read from memory once. A separate fat version
  (reduction blocked for the cache) is not built: it pays only once a B panel (K x NB floats)
  outgrows L2, and no layer of the models at hand comes near (register_tile.py's limit).
- SHORT_TILE_ROWS <= M < rows (register-tile kernels: GEMMs and direct convs): SHORT_ROW_TILES,
  tiles of 4 rows, panels outermost; a GEMM over a few tokens, the direct conv's 4- to 14-wide
  maps (ResNet-18's last two stages at 128x128 input). One row at a time there re-read the
  weights per row: ResNet-18's 256 -> 512 stride-2 conv at 4x4 ran 1046-1184 us, in 4-row
  tiles 298-306 us (register_tile.short_tile_knobs). Both also run them on longer rows where
  they take fewer issue slots than the long tiles, whose shifted last tile computes up to a
  tile of rows twice (a 16-wide row or 16 tokens in 15-row tiles: register_tile.version_slots).
- M below that: SINGLE_ROW, one row at a time across wide vector panels, parallel over the
  panels; skinny GEMMs (GEMV-like), direct convs under 4 columns wide, and the width and
  depthwise kernels' maps narrower than a vector (their tile is a vector of columns; they have
  no short version). A GEMM also runs it on more rows where it takes fewer issue slots than
  4-row tiles that compute some rows twice (5 tokens: 8 rows), its row across several of the
  weight's panels (register_tile.single_row_knobs).
The thresholds are tile heights because that is where a tile stops fitting: the shifted
tail needs M >= its rows. A static M compiles only its own version.
A pointwise conv over many input channels has CHANNEL_VECTORS in place of ROW_TILES (vectors
along the output channels, tiles of a few pixels: conv2d.uses_channel_vectors), from a tile of
pixels up (conv2d.channel_vector_buckets).

A second, orthogonal split is by work: waking the thread pool costs more than a small kernel's
whole run (measured on this 2-core host, TVM 0.27: a parallel loop over 48 x 32 floats 5.5 us,
the same loop serial 0.06 us; at 4096 x 32 serial still won, 7 us against 14 us). So every
kernel whose loop work (innermost iterations, summed over its loop nests) can fall below
`min_parallel_work` gets a serial version beside its parallel one, chosen by the same kind of
`if` (`parallel_buckets`). What a second thread saves differs by loop, so the work counts what
it saves, in elementwise iterations: a register-tiled multiply-accumulate (a dense conv's or
GEMM's tile update) counts 1/MAC_WORK_DIVISOR per MAC. The threshold is where a chain of
elementwise loops starts to run faster in parallel than serially (knob_search.py measures it
on the target and stores it in the knob database); DEFAULT_MIN_PARALLEL_WORK is this host's
value.
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx

from .register_tile import KERNEL_ANNOTATION, ROW_TILES, SHORT_ROW_TILES, SINGLE_ROW
from .tail_tiles import rewrite_loop_nest


def row_buckets(row_extent, rows: int, short_rows: int | None = None,
                slots=None) -> list[tuple[str, object]]:
    """[(version, run-time condition or None for "otherwise")], most specific first:
    ROW_TILES from `rows` on, SHORT_ROW_TILES from `short_rows` where given and smaller than
    `rows`, SINGLE_ROW below. With `slots(version, extent)` (register_tile.version_slots of
    each version's tile; None for a version not costed), a version runs only where no costed
    version after it takes fewer."""
    versions = [(ROW_TILES, rows)]
    if short_rows is not None and short_rows < rows:
        versions.append((SHORT_ROW_TILES, short_rows))
    versions.append((SINGLE_ROW, 1))

    def conditions(index: int, extent) -> list:
        version, least = versions[index]
        costed = [later for later, _ in versions[index + 1:]
                  if slots is not None and slots(later, extent) is not None]
        costs = [slots(version, extent) <= slots(later, extent) for later in costed]
        return [extent >= least, *costs]

    if isinstance(row_extent, (int, tirx.IntImm)):
        extent = int(row_extent)
        return [(next((version for index, (version, _) in enumerate(versions[:-1])
                       if all(conditions(index, extent))), SINGLE_ROW), None)]
    return [(version, tirx.all(*conditions(index, row_extent)))
            for index, (version, _) in enumerate(versions[:-1])] + [(SINGLE_ROW, None)]


# Measured on this 2-core host, whole zoo models timed with thresholds from 2^16 to 2^21: 2^17
# ran the small models fastest (conv_dynamic_hw at 32x32 36 -> 21 us, detector_fpn at 1x3x32x48
# 48 -> 36 us, speech_encoder at 2x77x40 56 -> 44 us); the others moved by 4% or less (detector_fpn
# at batch 2 3-4% slower in two sweeps, resnet_style at batch 4 0-3% faster); at 2^18
# grouped_convnet's depthwise convs and max pools went serial and it lost 15-40%. The kernels'
# own serial and parallel times put it there too: data that stays on its core makes a parallel
# chain of elementwise loops pay from 2^16 iterations, data that moves to the other core from
# 2^19 (knob_search.calibrate_min_parallel_work measures both).
DEFAULT_MIN_PARALLEL_WORK = 1 << 17

# A second thread saves ~3.5 ps per MAC of a register-tiled conv (24 -> 24 channels 3x3 at
# 32x32: 88 -> 70 us; 1.8-6 ps over 1x1 and 3x3 convs of 1-9 M MACs) and ~30-45 ps per element
# of an elementwise loop, measured on this host; the FMA units, not memory, bound the tile
# update. Without the divisor, conv_dynamic_hw's convs (0.33 and 0.66 M MACs at 32x32, 4.5 and
# 8.5 us serial) ran in parallel, and the model took 36 us; with them serial, 21-24 us.
MAC_WORK_DIVISOR = 8

# A block annotated so runs on the calling thread: it may raise an error through a callback
# (frontend/ops_gather.py), and TVM's thread pool drops an error that a worker thread raises.
SERIAL = "tightfit.serial"


def parallel_buckets(work, min_parallel_work: int) -> list[tuple[bool, object]]:
    """[(parallel?, run-time condition or None for "otherwise")] for a kernel's loop work.

    A symbolic work that reaches the threshold with every dim at 1 (extents grow with the dims
    they are computed from) always does: no serial version then, which halves the code LLVM
    compiles for, e.g., a conv whose only symbolic dim is the batch.
    """
    if work is None:
        return [(True, None)]
    if isinstance(work, (int, tirx.IntImm)):
        return [(int(work) >= min_parallel_work, None)]
    analyzer = tvm.sym.Analyzer()
    for var in tirx.analysis.undefined_vars(work):
        analyzer.bind(var, tirx.const(1, var.ty.dtype))
    smallest = analyzer.simplify(work)
    if isinstance(smallest, tirx.IntImm) and smallest.value >= min_parallel_work:
        return [(True, None)]
    return [(True, work >= min_parallel_work), (False, None)]


def loop_work(sch: s_tir.Schedule, mac_kernels: frozenset[str] = frozenset()):
    """Innermost iterations of the top-level loop nests of the function `sch` schedules, summed,
    those of a block whose kernel kind is in `mac_kernels` divided by MAC_WORK_DIVISOR, and
    none of a SERIAL block, which never runs in parallel; None when a loop extent depends on
    something other than the parameters' shapes (a data-dependent loop)."""
    func = sch.mod["main"]
    shape_vars = _shape_symbols(func) + [param for param in func.params
                                         if not hasattr(param, "shape")]
    total = tirx.const(0, "int64")
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        if SERIAL in sch.get(block).annotations:
            continue
        nest = tirx.const(1, "int64")
        for loop in sch.get_loops(block):
            extent = sch.get(loop).extent
            if not all(any(var.same_as(known) for known in shape_vars)
                       for var in tirx.analysis.undefined_vars(extent)):
                return None
            nest = nest * tirx.Cast("int64", extent)
        if str(sch.get(block).annotations.get(KERNEL_ANNOTATION, "")) in mac_kernels:
            nest = tirx.floordiv(nest, MAC_WORK_DIVISOR)
        total = total + nest
    return tvm.sym.Analyzer().simplify(total)


def serial_twin(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """A parallel version of a kernel with its parallel loops run serially: the small-work
    version beside it (`parallel_buckets`), made from it instead of scheduled again: TVM's
    schedule primitives take 3-9 ms each on a symbolic kernel, and scheduling the serial
    versions as well made MobileNetV2's ScheduleKernels call them 17,482 times instead of
    10,893 (10.5-11.5 s against 6.8-7.1 s). It
    keeps what the parallel schedule did for the threads' sake (the fused outer loops, packing
    stages shared out in row blocks); the loops and their order are the same otherwise."""

    def serial(loop: tirx.For) -> tirx.For | None:
        if loop.kind != tirx.ForKind.PARALLEL:
            return None
        return tirx.For(loop.loop_var, loop.min, loop.extent, tirx.ForKind.SERIAL, loop.body,
                        loop.thread_binding, loop.annotations)

    return func.with_body(rewrite_loop_nest(func.body, lambda realize: realize, serial))


def combine(*conditions):
    """The conjunction of the conditions that are not None (None when all are)."""
    present = [c for c in conditions if c is not None]
    if not present:
        return None
    result = present[0]
    for condition in present[1:]:
        result = tirx.And(result, condition)
    return result


def nested_ifs(versions: list[tuple[object, tirx.Stmt]]) -> tirx.Stmt:
    """The statement running the first version whose condition holds (the last has None), for
    kernels built as statements rather than schedules (row_kernels.py, pool_kernels.py)."""
    body = versions[-1][1]
    for condition, stmt in reversed(versions[:-1]):
        body = tirx.IfThenElse(condition, stmt, body)
    return body


def join_versions(versions: list[tuple[object, tirx.PrimFunc]]) -> tirx.PrimFunc:
    """One PrimFunc running the first version whose condition holds (the last has None).

    All versions are schedules of the same PrimFunc, so they share its parameters. Each version
    keeps its intermediate buffers in a block of its own under its branch: allocated at the root,
    a buffer used by two branches would have the root as its lowest common user, and
    CompactBufferAllocation would keep it at full size, so a kernel's accumulator tile would be
    a heap workspace instead of a stack array in registers (isa.py). Loops and buffers that the
    versions share are defined once per branch; ConvertSSA renames the repeats.
    """
    if len(versions) == 1:
        return versions[0][1]
    body = None
    for index, (condition, func) in reversed(list(enumerate(versions))):
        root = (func if index == 0 else _with_fresh_intermediates(func)).body.block
        branch = s_tir.SBlockRealize([], tirx.const(True, "bool"), s_tir.SBlock(
            [], [], [], f"version_{index}", root.body, None, root.alloc_buffers))
        body = branch if body is None else tirx.IfThenElse(condition, branch, body)
    first_root = versions[0][1].body
    root = first_root.block
    joined = s_tir.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint, body, root.init,
                          [], root.match_buffers, root.annotations)
    func = versions[0][1].with_body(s_tir.SBlockRealize(first_root.iter_values,
                                                        first_root.predicate, joined))
    return tirx.transform.ConvertSSA()(tvm.IRModule({"main": func}))["main"]


def run_first_where(func: tirx.PrimFunc, condition, body: tirx.Stmt) -> tirx.PrimFunc:
    """`func` running `body` where `condition` holds and its own body elsewhere: a version built
    as a statement (direct_depthwise.py) beside the versions `join_versions` joined. The
    buffers `func`'s root block allocates move into a block under the other branch, as
    `join_versions` puts each version's, so that the statement's branch allocates none."""
    if isinstance(condition, tirx.IntImm):
        return func.with_body(body) if condition.value else func
    realize = func.body
    root = realize.block
    own = s_tir.SBlockRealize([], tirx.const(True, "bool"), s_tir.SBlock(
        [], [], [], "scheduled_versions", root.body, None, root.alloc_buffers))
    joined = s_tir.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint,
                          tirx.IfThenElse(condition, body, own), root.init, [],
                          root.match_buffers, root.annotations)
    return func.with_body(s_tir.SBlockRealize(realize.iter_values, realize.predicate, joined))


def with_dims_known_non_negative(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with its body under `if d >= 0` for each scalar parameter d that a buffer's shape
    is an expression of: a dim symbol the caller passes because no buffer has it as a dim of
    its own (the input width w of an im2col GEMM over a width of w // 2 + 1). TVM takes a
    buffer's dims as non-negative, which leaves w >= -2 there; the flat-pixel index's region
    then divides by w // 2 + 1 behind a Select that StmtSimplify folds at w = -2, and code
    generation stopped on "Divide by zero". The run-time cost is one comparison per call."""
    shape_symbols = _shape_symbols(func)
    dims = [param for param in func.params if not hasattr(param, "shape")
            and any(param.same_as(symbol) for symbol in shape_symbols)]
    if not dims or not isinstance(func.body, s_tir.SBlockRealize):
        return func
    realize = func.body
    root = realize.block
    guarded = tirx.IfThenElse(combine(*[dim >= tirx.const(0, dim.ty.dtype) for dim in dims]),
                              root.body, None)
    return func.with_body(s_tir.SBlockRealize(realize.iter_values, realize.predicate, s_tir.SBlock(
        root.iter_vars, root.reads, root.writes, root.name_hint, guarded, root.init,
        root.alloc_buffers, root.match_buffers, root.annotations)))


def _shape_symbols(func: tirx.PrimFunc) -> list[tirx.Var]:
    """The variables the shapes of `func`'s buffer parameters are expressions of."""
    return [var for param in func.params if hasattr(param, "shape")
            for dim in param.shape for var in tirx.analysis.undefined_vars(dim)]


def _with_fresh_intermediates(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with new buffer objects for the intermediates allocated at its root, so that a
    version does not share them with the others (TIR allows one definition per buffer).

    set_scope gives a block's output buffer a new object when the scope changes; changing it
    to another scope and back keeps the scope and leaves a fresh buffer.
    """
    sch = s_tir.Schedule(func)
    writers = _writer_blocks(func)
    for buffer in func.body.block.alloc_buffers:
        block_name, index = writers[buffer.name]
        scope = buffer.scope()
        sch.set_scope(sch.get_sblock(block_name), index, "local" if scope != "local" else "global")
        sch.set_scope(sch.get_sblock(block_name), index, scope)
    return sch.mod["main"]


def _writer_blocks(func: tirx.PrimFunc) -> dict[str, tuple[str, int]]:
    """Buffer name -> (a block writing it, the buffer's index among that block's writes)."""
    writers: dict[str, tuple[str, int]] = {}

    def note(realize):
        for index, region in enumerate(realize.block.writes):
            writers.setdefault(region.source.name, (realize.block.name_hint, index))
        return realize

    rewrite_loop_nest(func.body.block.body, note)
    return writers
