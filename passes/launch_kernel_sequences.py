"""Call each sequence of kernels from one TIR function, its intermediate tensors in arenas.

MNN §3.2, resource pre-allocation: the work of managing memory is done apart from the work of
computing, and a run executes only the computing. DESIGN §11: tensors get their planned offsets
in an arena. Without this pass the Relax VM does per kernel what only the plan needs: it builds
each output's shape, allocates a tensor object for it, calls the kernel through its register
file, and frees the objects after their last use. On a small model that is most of the run:
transformer_encoder_dynamo at 1x5 tokens spent 40 us a run in the VM function, of which its 31
kernels took 9 us; with its kernels in one sequence the VM function takes 12 us.

Here, a sequence of kernel calls with nothing else in between but allocations and views becomes
one PrimFunc that calls the kernels in order, each tensor's descriptor built on the stack. The
calls are `T.call_cpacked`, straight to the kernel's symbol in the same library (a packed call
would look the name up among the library's imports, where the kernels are not). The storages
TVM and ShareSymbolicStorage planned for tensors that live only inside the sequence are laid
out one after another in one arena, at offsets that are expressions of the symbolic dims. The
sequence takes its arena from TVM's workspace pool as it starts and gives it back as it ends
(TVMBackendAllocWorkspace: a pool per thread, no lock, 64-byte aligned), and the VM calls it
once. The arena is at least 1 KiB, the size from which TVM's lowering never makes it a stack
array: the kernels, which then assumed 64-byte aligned arguments, stored their 16-lane vectors
into the arena with instructions that need that alignment, which the stack array TVM 0.27 made
of a 512-byte arena did not have (the function does not realign the stack), so a run crashed
or not depending on where the stack sat. (Kernels now assume only element alignment of their
arguments, kernel_lowering.py; the minimum stays so that every slot starts on a cache line,
and a kernel's vector loads from a slot's start do not split across two.) The sequence calls
each kernel's function; LLVM does not inline them (transformer_encoder_dynamo,
nonzero_gather, mobilenet_v2_style: a call per kernel in the sequence's code). A tensor the
rest of the function sees (an output, a value after the sequence or in a branch) keeps its
Relax allocation and is passed in.

The arena was first a VM allocation, passed in: a storage and a tensor object a run, 0.25 us
in TVM 0.27's VM (a storage alone 0.11 us, a tensor alone 0.14 us; a kernel call 5 ns).
Measured, the VM's call alone, both builds in one process in alternating turns, median of 30:
nonzero_gather at 4x12 3.15 -> 2.68 us (one arena a run), nonzero_rows_tied at 3x4 4.49 ->
3.81 us (two), the transformers within +-1%. Where an arena is large, its place in memory
moves runs by more than that either way: mobilenet_v2_style at 1x3x64x64 +8.5% in one process,
-12% with each build in its own process (three of each).

A count read back into a new dim (NonZero's: a kernel counts, the count becomes the dim of
the tensors after it; SoD2's execution-determined dims) does not end a sequence: the sequence
binds the dim to the count where the kernel has written it, and the storages sized by the dim
go into a second arena, taken from the pool right there. The VM still reads the count back
after the call, for what it does with the dim later (WriteScalarsToShapeHeap then stores it
straight into the shape heap). Where a tensor the VM allocates before the call needs the dim
(an output of `count` rows), the read-back stays in the VM between two sequences. Measured,
the VM call alone, one process, median of 30: nonzero_gather at 4x12 2.42 -> 1.83 us (one
sequence instead of two, and no VM allocation for the mask they shared).

The Relax function as it was stays in the module under `interpreted(name)` for the profiler,
which times each kernel through the VM's instrument (vm_code.py).

A tuple of tensors (a Split's outputs) and the items taken of it are views of those tensors
too: TorchScript's exporter splits a transformer's q, k and v so, and transformer_encoder ran
in three sequences with two kernels left to the VM, in one now. The run timed in the VM, both
builds in one process in turns, median of 15: transformer_encoder 1x5 11.32 -> 5.84 us, 3x16
36.68 -> 29.93 us, 2x33 63.82 -> 55.90 us; speech_encoder (two sequences -> one) 1x40x40
11.29 -> 8.65 us, 2x77x40 30.38 -> 27.32 us; no other zoo model has such a tuple.

Limits: a sequence ends at anything that is not a kernel call, an allocation, a view, a tuple
of tensors or a count read back into a new dim (an `If`, a packed library call, a dim compared with one known, which
CheckDimsOnShapes leaves only where the comparison defines a dim), and
is lowered only when it calls at least MIN_KERNELS kernels. An arena holds each storage for the
whole sequence, so it is the sum of its storages; sharing between them is
ShareSymbolicStorage's, before this.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import tvm
from tvm import relax, tirx

from tightfit.schedules.isa import MAX_STACK_ALLOCA_BYTES
from tightfit.vm_code import interpreted

from .classify_dynamism import op_key

# A sequence of one kernel saves nothing: the VM would call it instead of the kernel.
MIN_KERNELS = 2
# Every tensor in the arena starts on a cache line; kernels load vectors from the start of each.
ARENA_ALIGNMENT = 64
# Each slot starts this many bytes (5 cache lines) past the end of the one before, the first past
# the arena's start. Activations are often whole multiples of 4 KiB (C x H x W floats), so slots
# laid end to end would all begin at the same offset within a page, and so would the
# allocator's page-aligned tensors. A kernel that loads from one tensor while it stores to
# another at the same offset within a page makes each load wait on the store ahead of it
# (the CPU matches a load against earlier stores by their address's low 12 bits first: 4 KiB
# aliasing). Measured, the run timed in the VM, variants in one process in turns, median of 7:
# mobilenet_v2_style at 1x3x64x64 79.1 -> 65.4 us, at 2x3x96x80 -4%, the other zoo CNNs and
# transformers within +-1.2%. Spacing slots by 1 line gained less (78.1 -> 69.3 us), by 33 lines
# as much (65.8 us against 62.9 us for 5, in one run).
SLOT_STAGGER = 5 * ARENA_ALIGNMENT

# DLPack's codes for the CPU and for unsigned integers, as TVMBackendAllocWorkspace takes them
_CPU = tirx.IntImm("int32", 1)
_UINT_CODE = tirx.IntImm("int32", 1)

# The sequence PrimFunc's attribute listing each storage's place in its arena.
ARENA_SLOTS_ATTR = "tightfit.arena_slots"

# Element types whose tensors keep their kernel calls in the VM: a descriptor TVM 0.27 builds on
# the stack for a bfloat16 tensor fails the kernel's dtype check.
_UNDESCRIBED_DTYPES = ("bfloat16",)

_ALLOCATIONS = ("relax.memory.alloc_storage", "relax.memory.alloc_tensor", "relax.builtin.alloc_tensor")


@tvm.transform.module_pass(opt_level=0, name="tightfit.LaunchKernelSequences")
class LaunchKernelSequences:
    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        builder = relax.BlockBuilder(mod)
        for global_var, func in list(mod.functions.items()):
            if not isinstance(func, relax.Function) or "global_symbol" not in (func.attrs or {}):
                continue
            copy = with_own_vars(func, mod)
            if copy is None:
                continue
            lowered = _rewrite_seq(func.body, _Lowering(builder, mod, _dims_defined_once(func)))
            if lowered.same_as(func.body):
                continue
            builder.update_func(global_var, builder.normalize(relax.Function(
                func.params, lowered, func.ret_ty, func.is_pure, func.attrs, func.span)))
            symbol = str(func.attrs["global_symbol"])
            builder.add_func(copy.with_attr("global_symbol", interpreted(symbol)), interpreted(symbol))
        return builder.finalize()


def kernel_sequences(mod: tvm.IRModule) -> dict[str, tirx.PrimFunc]:
    """The sequence functions this pass made in `mod`, by name."""
    return {global_var.name_hint: func for global_var, func in mod.functions.items()
            if isinstance(func, tirx.PrimFunc) and ARENA_SLOTS_ATTR in (func.attrs or {})}


def kernel_calls(sequence: tirx.PrimFunc) -> int:
    """How many kernel calls a sequence function makes."""
    return sum(isinstance(statement, tirx.Evaluate) and isinstance(statement.value, tvm.ir.Call)
               and statement.value.op.name == "tirx.tvm_call_cpacked" for statement in sequence.body.seq)


def with_own_vars(func: relax.Function, mod: tvm.IRModule) -> relax.Function | None:
    """A copy of `func` with vars of its own (a var may be defined in one function only), or
    None where TVM cannot copy it. relax.utils.copy_with_new_vars re-infers the type of every
    call it rebuilds, which TVM 0.27 cannot for an if_then_else inside a symbolic shape; a
    round trip through JSON copies every node as it is (the copy's calls are then pointed back
    at the module's functions), but cannot read back a constant with no elements and more
    than one dim. Such a function keeps its kernel calls in the VM.

    The attributes make no trip: the copy shares the function's, whose "params" (the weights,
    until split_weights) were most of the JSON (ResNet-18: 80 MB, 1.2 s of this pass's 1.3 s)."""
    bare = relax.Function(func.params, func.body, func.ret_ty, func.is_pure, None, func.span)
    try:
        copy = tvm.ir.load_json(tvm.ir.save_json(bare))
    except tvm.error.InternalError:
        return None
    copy = _ModuleGlobalVars(mod).visit_expr(copy)
    return relax.Function(copy.params, copy.body, copy.ret_ty, copy.is_pure, func.attrs, copy.span)


@relax.expr_functor.mutator
class _ModuleGlobalVars(relax.PyExprMutator):
    """Replaces each GlobalVar with the module's of the same name."""

    def visit_global_var_(self, op: tvm.ir.GlobalVar) -> relax.Expr:
        return self.builder_.get().get_global_var(op.name_hint)


@dataclass
class _Lowering:
    builder: relax.BlockBuilder
    mod: tvm.IRModule
    # the symbolic dims a match_cast of a shape defines: in one match_cast, not a parameter's
    dims_defined_in_body: set

    def is_read_back(self, bindings: list, index: int) -> bool:
        """Is `bindings[index]` a count read back into a new dim (a one-element int64 tensor to
        a shape, then that shape cast to one new symbolic dim), or the cast of one?"""
        first = index if op_key(bindings[index].value) == "relax.tensor_to_shape" else index - 1
        if first < 0 or first + 1 >= len(bindings) or bindings[first] is None or bindings[first + 1] is None:
            return False
        to_shape, cast = bindings[first], bindings[first + 1]
        if op_key(to_shape.value) != "relax.tensor_to_shape" or not isinstance(cast, relax.MatchCast):
            return False
        tensor, ty = to_shape.value.args[0], cast.ty
        return (_is_tensor(tensor) and str(tensor.ty.dtype) == "int64" and tensor.ty.shape is not None
                and [int(dim) for dim in tensor.ty.shape.values] == [1] and cast.value.same_as(to_shape.var)
                and isinstance(ty, relax.ShapeType) and ty.values is not None and len(ty.values) == 1
                and isinstance(ty.values[0], tirx.Var) and ty.values[0] in self.dims_defined_in_body)

    def is_kernel(self, value: relax.Expr) -> bool:
        return (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.GlobalVar)
                and isinstance(self.mod[value.op], tirx.PrimFunc)
                and all(_is_tensor(arg) or isinstance(arg.ty, tvm.ir.PrimType) for arg in value.args))


def _dims_defined_once(func: relax.Function) -> set:
    """The symbolic dims of `func` that one match_cast defines and no parameter has."""
    in_params = {var for param in func.params
                 for var in relax.analysis.definable_tir_vars_in_type(param.ty)}
    counts: dict = {}

    def visit(seq: relax.SeqExpr):
        for block in seq.blocks:
            for binding in block.bindings:
                if isinstance(binding, relax.MatchCast):
                    for var in relax.analysis.definable_tir_vars_in_type(binding.ty):
                        counts[var] = counts.get(var, 0) + 1
                if isinstance(binding.value, relax.If):
                    visit(binding.value.true_branch)
                    visit(binding.value.false_branch)

    visit(func.body)
    return {var for var, count in counts.items() if count == 1 and var not in in_params}


def _is_tensor(expr: relax.Expr) -> bool:
    ty = expr.ty
    return (isinstance(expr, (relax.Var, tvm.ir.Constant, tvm.ir.GenericConst))
            and isinstance(ty, relax.TensorType) and ty.ndim >= 0
            and str(ty.dtype) not in ("", *_UNDESCRIBED_DTYPES))


def _rewrite_seq(seq: relax.SeqExpr, lowering: _Lowering) -> relax.SeqExpr:
    """`seq` with its kernel sequences lowered, in branches too."""
    uses: dict[tuple[int, int], set[relax.Var]] = {}
    for block_index, block in enumerate(seq.blocks):
        for index, binding in enumerate(block.bindings):
            uses[(block_index, index)] = set(relax.analysis.free_vars(binding.value))
    body_uses = set(relax.analysis.free_vars(seq.body))
    blocks, changed = [], False
    for block_index, block in enumerate(seq.blocks):
        bindings = [with_branches_rewritten(binding, lambda branch: _rewrite_seq(branch, lowering),
                                            lowering.builder) for binding in block.bindings]
        changed |= any(not new.same_as(old) for new, old in zip(bindings, block.bindings))
        storages = {binding.var for binding in bindings
                    if op_key(binding.value) == "relax.memory.alloc_storage"}
        def used_elsewhere(span: list[int]) -> set[relax.Var]:
            members = {(block_index, index) for index in span}
            return body_uses.union(*(used for where, used in uses.items() if where not in members))

        spans = [part for span in _kernel_spans(bindings, lowering)
                 for part in _parts(bindings, span, used_elsewhere, storages, lowering)]
        # later sequences first, so that the positions of earlier ones stay as they were
        for span in reversed(spans):
            elsewhere = used_elsewhere(span)
            bindings[span[0]:span[-1] + 1] = _lower_sequence(
                bindings, span, elsewhere, storages - elsewhere, lowering)
            changed = True
        blocks.append(relax.BindingBlock([binding for binding in bindings if binding is not None]))
    return lowering.builder.normalize(relax.SeqExpr(blocks, seq.body)) if changed else seq


def with_branches_rewritten(binding: relax.Binding, rewrite_seq: Callable[[relax.SeqExpr], relax.SeqExpr],
                            builder: relax.BlockBuilder) -> relax.Binding:
    """`binding` with each branch of its `If`, if it binds one, rewritten by `rewrite_seq`."""
    value = binding.value
    if not isinstance(binding, relax.VarBinding) or not isinstance(value, relax.If):
        return binding
    true_branch = rewrite_seq(value.true_branch)
    false_branch = rewrite_seq(value.false_branch)
    if true_branch.same_as(value.true_branch) and false_branch.same_as(value.false_branch):
        return binding
    return relax.VarBinding(binding.var, builder.normalize(relax.If(value.cond, true_branch, false_branch)))


def _is_view(binding: relax.Binding) -> bool:
    """A tensor that is another's memory: the same var, a reshape of it, or an item of a tuple
    of tensors (`_tuple_fields`, resolved by `_viewed`)."""
    value = binding.value
    return isinstance(binding, relax.VarBinding) and _is_tensor(binding.var) and (
        (isinstance(value, relax.Var) and _is_tensor(value))
        or (op_key(value) == "relax.reshape" and isinstance(value.args[0], relax.Var)
            and binding.var.ty.shape is not None)
        or (isinstance(value, relax.TupleGetItem) and isinstance(value.tuple_value, relax.Var)))


def _tuple_fields(binding: relax.Binding) -> list[relax.Var] | None:
    """The tensors of the tuple that `binding` makes of tensor vars (a Split's outputs, as
    TorchScript's exporter writes a transformer's q, k, v), or None."""
    value = binding.value
    if (isinstance(binding, relax.VarBinding) and isinstance(value, relax.Tuple) and value.fields
            and all(isinstance(field, relax.Var) and _is_tensor(field) for field in value.fields)):
        return list(value.fields)
    return None


def _tuples_in(bindings: list[relax.Binding | None]) -> dict[relax.Var, list[relax.Var]]:
    """The tuples of tensors among `bindings` (a block's: an item's tuple may lie in an
    earlier part of a span cut at a count read back), by var."""
    return {binding.var: fields for binding in bindings
            if binding is not None and (fields := _tuple_fields(binding)) is not None}


def _kernel_spans(bindings: list[relax.Binding], lowering: _Lowering) -> list[list[int]]:
    """The positions of each sequence to lower: maximal runs of kernel calls, allocations,
    views, tuples of tensors (an item taken of one made in the run), and counts read back into
    new dims, with at least MIN_KERNELS calls."""
    spans, current, tuples = [], [], set()
    for index, binding in enumerate(bindings + [None]):
        if binding is not None and (lowering.is_read_back(bindings, index) or (
                isinstance(binding, relax.VarBinding) and (
                    lowering.is_kernel(binding.value) or op_key(binding.value) in _ALLOCATIONS
                    or _tuple_fields(binding) is not None
                    or (_is_view(binding) and (not isinstance(binding.value, relax.TupleGetItem)
                                               or binding.value.tuple_value in tuples))))):
            current.append(index)
            if _tuple_fields(binding) is not None:
                tuples.add(binding.var)
            continue
        if _kernels_in(bindings, current, lowering) >= MIN_KERNELS:
            spans.append(current)
        current, tuples = [], set()
    return spans


def _kernels_in(bindings: list, span: list[int], lowering: _Lowering) -> int:
    return sum(lowering.is_kernel(bindings[i].value) for i in span)


def _parts(bindings, span, used_elsewhere, storages, lowering) -> list[list[int]]:
    """`span` cut at each count read back whose dim an allocation or view the VM keeps after it
    needs (the VM makes those before it calls the sequence, when the dim is not known yet);
    the read-back stays in the VM there. Parts of fewer than MIN_KERNELS calls are dropped."""
    while len(span) > 2 and op_key(bindings[span[-2]].value) == "relax.tensor_to_shape":
        span = span[:-2]  # a count read back last is read for the VM alone: it stays there
    elsewhere = used_elsewhere(span)
    escaping, internal = _placement(bindings, span, elsewhere, storages - elsewhere)
    for position, index in enumerate(span):
        if op_key(bindings[index].value) != "relax.tensor_to_shape":
            continue
        dim = _read_back_dim(bindings, index)
        needs_dim = [bindings[i] for i in span[position + 2:]
                     if _kept(bindings[i], escaping, internal, lowering) and dim in _symbolic_vars_of(bindings[i])]
        if needs_dim:
            return [part for piece in (span[:position], span[position + 2:])
                    if _kernels_in(bindings, piece, lowering) >= MIN_KERNELS
                    for part in _parts(bindings, piece, used_elsewhere, storages, lowering)]
    return [span]


def _read_back_dim(bindings: list, to_shape_index: int) -> tirx.Var:
    """The new dim that the match_cast after a read-back defines."""
    return bindings[to_shape_index + 1].ty.values[0]


def _symbolic_vars_of(binding: relax.Binding) -> set:
    return set(relax.analysis.free_symbolic_vars(binding.value)) | set(
        relax.analysis.tir_vars_in_type(binding.var.ty))


@dataclass
class _Sequence:
    """What the lowered function knows of each Relax value of the sequence."""
    # each storage moved into an arena: (the arena's index, its byte offset there, its size)
    arena_slots: dict[relax.Var, tuple[int, tirx.PrimExpr, tirx.PrimExpr]] = field(default_factory=dict)
    # the bytes of each arena: the first allocated as the sequence starts, each other right after
    # the count it is sized by is read back
    arena_bytes: list[tirx.PrimExpr] = field(default_factory=list)
    # internal tensors: (the storage var or external tensor it lies in, its byte offset there)
    placement: dict[relax.Var, tuple[relax.Expr, tirx.PrimExpr]] = field(default_factory=dict)
    # the tensors passed in, each with the buffer the PrimFunc declares for it
    passed: dict[relax.Expr, tirx.Buffer] = field(default_factory=dict)
    # the dims of passed tensors whose Relax type has no shape: read from the tensor
    unnamed_dims: list[tirx.Var] = field(default_factory=list)
    # the dims read back inside the sequence, in order
    read_back_dims: list[tirx.Var] = field(default_factory=list)
    # the first arena's buffer, allocated in the sequence's body, not passed in (None: no slots)
    arena: tirx.Buffer | None = None
    # each later arena's pointer and bytes, taken from TVM's workspace pool once its count is
    # known (None: no slots). Not a buffer: TVM's lowering moves a buffer's allocation up to
    # the start of the function, before its size is known.
    later_arenas: list[tuple[tirx.Var, tirx.PrimExpr] | None] = field(default_factory=list)

    def arena_data(self, arena: int) -> tirx.PrimExpr:
        return self.arena.data if arena == 0 else self.later_arenas[arena - 1][0]

    def add_slot(self, storage: relax.Var, size: tirx.PrimExpr) -> None:
        """A slot for `storage` in the first arena allocated once its size is known."""
        used = set(tirx.analysis.undefined_vars(size, []))
        arena = max([0] + [1 + k for k, dim in enumerate(self.read_back_dims) if dim in used])
        start = self.arena_bytes[arena] + SLOT_STAGGER
        self.arena_slots[storage] = (arena, start, size)
        self.arena_bytes[arena] = _aligned(start + size)


def _placement(bindings, span, used_elsewhere, storages_used_only_here) -> tuple[set, set]:
    """The vars of `span` that the rest of the function sees (escaping), and the storages whose
    tensors only the span uses (internal: they go into its arenas)."""
    members = [bindings[i] for i in span if bindings[i] is not None]
    # a count read back is read by the VM after the sequence, to know the dim too
    escaping = set(used_elsewhere) | {binding.value.args[0] for binding in members
                                      if op_key(binding.value) == "relax.tensor_to_shape"}
    tuples = _tuples_in(bindings)
    for binding in reversed(members):  # a view of a tensor the rest sees is seen there too
        if binding.var in escaping and _is_view(binding):
            escaping.add(_viewed(binding, tuples))
        if binding.var in escaping and binding.var in tuples:
            escaping.update(tuples[binding.var])
    tensors = [binding for binding in members if op_key(binding.value) == "relax.memory.alloc_tensor"]
    homes = {binding.value.args[0] for binding in tensors}
    homes_seen_elsewhere = {binding.value.args[0] for binding in tensors if binding.var in escaping}
    return escaping, (set(storages_used_only_here) & homes) - homes_seen_elsewhere


def _kept(binding: relax.Binding, escaping: set, internal: set, lowering: _Lowering) -> bool:
    """Does the VM keep `binding` of a sequence, before the sequence's call?"""
    value = binding.value
    return not (lowering.is_kernel(value) or op_key(value) == "relax.tensor_to_shape"
                or isinstance(binding, relax.MatchCast) or binding.var in internal
                or (op_key(value) == "relax.memory.alloc_tensor" and value.args[0] in internal)
                or ((_is_view(binding) or _tuple_fields(binding) is not None)
                    and binding.var not in escaping))


def _lower_sequence(bindings, span, used_elsewhere, storages_used_only_here, lowering):
    """The bindings that replace `bindings[span]`: the allocations and views the rest of the
    function sees, one call of the sequence's PrimFunc, and the counts read back by it. The
    bindings of storages that only the sequence's tensors use, before the sequence, are set to
    None."""
    escaping, internal = _placement(bindings, span, used_elsewhere, storages_used_only_here)
    sequence = _Sequence(read_back_dims=[_read_back_dim(bindings, i) for i in span
                                         if op_key(bindings[i].value) == "relax.tensor_to_shape"])
    sequence.arena_bytes = [tirx.IntImm("int64", 0)] * (1 + len(sequence.read_back_dims))
    for index, binding in enumerate(bindings):
        if binding is not None and binding.var in internal:
            sequence.add_slot(binding.var, binding.value.args[0].values[0])
            if index < span[0]:
                bindings[index] = None
    for arena, arena_bytes in enumerate(sequence.arena_bytes):
        if not any(slot[0] == arena for slot in sequence.arena_slots.values()):
            sequence.later_arenas += [None] * (arena > 0)
            continue
        # never a stack array (see the module's docstring)
        heap_bytes = tvm.sym.Analyzer().simplify(
            tirx.max(arena_bytes, tirx.IntImm("int64", MAX_STACK_ALLOCA_BYTES)))
        if arena == 0:
            sequence.arena = tirx.decl_buffer([heap_bytes], "uint8", "arena")
        else:
            sequence.later_arenas.append((tirx.Var(f"arena{arena}", "handle"), heap_bytes))
    kept, steps, read_after = [], [], []
    tuples = _tuples_in(bindings)
    for index in span:
        binding = bindings[index]
        if binding is None:
            continue
        value = binding.value
        if lowering.is_kernel(value):
            steps.append((value.op, [_argument(arg, sequence) for arg in value.args]))
        elif op_key(value) == "relax.tensor_to_shape":
            steps.append((_read_back_dim(bindings, index), _passed(value.args[0], sequence)))
            read_after.append(binding)
        elif isinstance(binding, relax.MatchCast):
            read_after.append(binding)
        elif op_key(value) == "relax.memory.alloc_tensor" and value.args[0] in internal:
            sequence.placement[binding.var] = (value.args[0], value.args[1])
        elif binding.var in internal:
            continue
        elif binding.var in tuples and binding.var not in escaping:
            continue  # its items are views of its tensors
        elif _is_view(binding) and binding.var not in escaping:
            viewed = _viewed(binding, tuples)
            sequence.placement[binding.var] = sequence.placement.get(viewed, (viewed, _zero()))
        elif isinstance(value, relax.TupleGetItem):
            kept.append(relax.VarBinding(binding.var, _viewed(binding, tuples)))
        else:
            kept.append(binding)
    return kept + _launch(steps, sequence, lowering) + read_after


def _viewed(binding: relax.VarBinding, tuples: dict[relax.Var, list[relax.Var]]) -> relax.Var:
    """The tensor a view binding views; an item of a tuple from `tuples` (`_tuples_in`)."""
    value = binding.value
    if isinstance(value, relax.TupleGetItem):
        return tuples[value.tuple_value][value.index]
    return value if isinstance(value, relax.Var) else value.args[0]


def _aligned(size: tirx.PrimExpr) -> tirx.PrimExpr:
    size = tirx.Cast("int64", size) if str(size.ty) != "int64" else size
    return tvm.sym.Analyzer().simplify(
        tirx.floordiv(size + ARENA_ALIGNMENT - 1, ARENA_ALIGNMENT) * ARENA_ALIGNMENT)


def _zero() -> tirx.PrimExpr:
    return tirx.IntImm("int64", 0)


def _argument(arg: relax.Expr, sequence: _Sequence):
    """How one kernel argument is described to the kernel: a scalar as it is (a TIR expression
    in TVM 0.27), the buffer of a tensor passed in, or a descriptor of an internal tensor made
    on the stack: a place in the arena, or a view of a tensor passed in."""
    if isinstance(arg.ty, tvm.ir.PrimType):
        return arg
    if arg not in sequence.placement:
        return _passed(arg, sequence)
    home, offset = sequence.placement[arg]
    if home in sequence.arena_slots:
        arena, start, _ = sequence.arena_slots[home]
        byte = start + offset
        # the arena's pointer plus the offset, not the address of arena[byte]: TVM's lowering
        # shrinks an allocation to the elements read or written through it (from the first
        # slot's first byte to the last slot's first byte here), where a pointer used as such
        # keeps it whole
        data = tirx.call_intrin("handle", "tirx.handle_add_byte_offset", sequence.arena_data(arena), byte)
        elem_offset = _zero()
    else:
        buffer = _passed(home, sequence)
        data, elem_offset = buffer.data, buffer.elem_offset
    shape = list(arg.ty.shape.values)
    no_strides = tirx.reinterpret("handle", tirx.IntImm("uint64", 0))
    return tirx.tvm_stack_make_array(data, tirx.tvm_stack_make_shape(*shape), no_strides, len(shape),
                                     tirx.const(0, str(arg.ty.dtype)), elem_offset)


def _passed(tensor: relax.Expr, sequence: _Sequence) -> tirx.Buffer:
    """The buffer the PrimFunc declares for a tensor passed in."""
    if tensor not in sequence.passed:
        name, ty = f"tensor{len(sequence.passed)}", tensor.ty
        if ty.shape is not None:
            shape = list(ty.shape.values)
        else:
            shape = [tirx.Var(f"{name}_dim{axis}", "int64") for axis in range(ty.ndim)]
            sequence.unnamed_dims += shape
        sequence.passed[tensor] = tirx.decl_buffer(shape, ty.dtype, name)
    return sequence.passed[tensor]


def _launch(steps, sequence: _Sequence, lowering: _Lowering) -> list[relax.Binding]:
    """The call of the sequence's PrimFunc, which allocates its arenas itself. Each step is a
    kernel's call, or a count read back: the new dim bound to the count, then the arena of the
    storages sized by it taken from the workspace pool (and given back at the end)."""
    statements = [tirx.AllocBuffer(sequence.arena)] if sequence.arena is not None else []
    given_back = []
    for step in steps:
        if isinstance(step[0], tirx.Var):
            dim, count = step
            statements.append(tirx.Bind(dim, tirx.BufferLoad(count, [tirx.IntImm("int64", 0)])))
            later = sequence.later_arenas[sequence.read_back_dims.index(dim)]
            if later is not None:
                pointer, nbytes = later
                statements += [
                    tirx.Bind(pointer, tirx.call_intrin(
                        "handle", "tirx.TVMBackendAllocWorkspace", _CPU, tirx.IntImm("int32", 0),
                        tirx.Cast("uint64", nbytes), _UINT_CODE, tirx.IntImm("int32", 8))),
                    tirx.IfThenElse(tirx.call_intrin("bool", "tirx.isnullptr", pointer), tirx.Evaluate(
                        tirx.call_intrin("int32", "tirx.tvm_throw_last_error")), None)]
                given_back.insert(0, tirx.Evaluate(tirx.call_intrin(
                    "int32", "tirx.TVMBackendFreeWorkspace", _CPU, tirx.IntImm("int32", 0), pointer)))
            continue
        kernel, arguments = step
        # the symbol AttachGlobalSymbol will give the kernel, where it has none yet
        symbol = str((lowering.mod[kernel].attrs or {}).get("global_symbol", kernel.name_hint))
        statements.append(tirx.Evaluate(tirx.call_cpacked(symbol, *arguments)))
    statements += given_back
    body = tirx.SeqStmt(statements)
    buffers = list(sequence.passed.values())
    # every symbolic dim is passed as a scalar, ahead of the buffers whose shapes it gives
    # (the PrimFunc then checks each buffer's shape against them); not those read back inside
    dims = []
    extents = [extent for buffer in buffers + [sequence.arena] * (sequence.arena is not None)
               for extent in buffer.ty.shape]
    for expr in [body] + extents:
        dims += [var for var in tirx.analysis.undefined_vars(expr, buffers)
                 if var not in dims and var not in sequence.unnamed_dims
                 and var not in sequence.read_back_dims]
    slots_by_arena = [[[offset, size] for index, offset, size in sequence.arena_slots.values()
                       if index == arena] for arena in range(len(sequence.arena_bytes))]
    func = tirx.PrimFunc(dims + buffers, body).with_attrs({
        "tirx.is_scheduled": True,
        # (byte offset, bytes) of each storage in each arena, for checking and drawing the plan
        ARENA_SLOTS_ATTR: slots_by_arena})
    sequence_var = lowering.builder.add_func(func, "kernel_sequence")
    call = lowering.builder.normalize(relax.Call(sequence_var, dims + list(sequence.passed.keys())))
    return [relax.VarBinding(relax.Var("_", call.ty), call)]
