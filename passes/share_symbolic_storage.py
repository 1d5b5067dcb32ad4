"""Share one storage between tensors of different symbolic sizes whose lifetimes do not overlap.

SoD2 §4.4.1 (memory plans with symbolic sizes). TVM's StaticPlanBlockMemory, which runs first,
reuses a storage for a tensor of symbolic size only when the two sizes are provably equal, so a
CNN with a symbolic batch and image size gets one storage per distinct size expression:
MobileNetV2 allocates 31 in a run where its static plan needs 7. Every extra storage is memory
the run touches once and that has left the cache by the next run.

This pass merges the storages TVM planned, greedily in execution order (greedy best fit on
symbolic sizes, the strategy SoD2 measures its own against; SoD2's order from the peak is not
done here): a storage allocated after another's last use takes that storage over, and the
shared storage's size becomes the larger of the two, `max(a, b)` as an
expression of the function's symbolic dims that the VM evaluates when it allocates. A max is
never more than the sum of the storages it replaces, so no shape needs more memory than before.
Which free storage to take is decided at a nominal shape (every symbolic dim NOMINAL_DIM) where
the analyzer cannot order two sizes for all shapes (a product of floor divisions, as every
strided stage has): the smallest one that fits, else the largest, as for static sizes.

Limits: storages are shared within one binding block (TVM plans nothing across blocks); a
storage whose size reads a symbolic dim bound inside the function (a NonZero count) keeps its
own allocation site, so it can take over others but not join one allocated earlier; a storage
used other than by `memory.alloc_tensor`, or whose tensors are used after the block, is left
as it is.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import tvm
from tvm import relax, tirx

from .classify_dynamism import op_key
from .rdp_lattice import describe_dim

# The value every symbolic dim takes when two sizes that no proof orders are compared to choose
# a storage: the choice changes how much memory is shared, never whether a plan is correct.
NOMINAL_DIM = 64
# A shared storage's size keeps at most this many terms in its max() (each one a multiply the
# VM evaluates per run, and a longer expression for later comparisons).
MAX_SIZE_TERMS = 8
# The function attribute listing the sizes of the storages left, as expressions of its dims.
STORAGE_BYTES_ATTR = "tightfit.storage_bytes"


class _Sizes:
    """Questions about the symbolic sizes of one function's storages."""

    def __init__(self, func: relax.Function):
        self.signature_dims = set()
        for param in func.params:
            self.signature_dims |= set(relax.analysis.definable_tir_vars_in_type(param.ty))
        self._proofs = tvm.sym.Analyzer()
        self._at_nominal_shape = tvm.sym.Analyzer()
        for dim in relax.analysis.defined_symbolic_vars(func):
            self._proofs.update(dim, tvm.sym.ConstIntBound(0, tvm.sym.ConstIntBound.POS_INF))
            self._at_nominal_shape.bind(dim, tirx.IntImm(str(dim.ty), NOMINAL_DIM))

    def covers(self, size: tirx.PrimExpr, other: tirx.PrimExpr) -> bool:
        """Whether `size` is at least `other` for every value of the dims."""
        return self._proofs.can_prove(size >= other)

    def nominal(self, size: tirx.PrimExpr) -> int:
        return int(self._at_nominal_shape.simplify(size))

    def known_at_entry(self, size: tirx.PrimExpr) -> bool:
        return set(tirx.analysis.undefined_vars(size)) <= self.signature_dims


@dataclass
class _Storage:
    var: relax.Var
    position: int
    size: tirx.PrimExpr
    kind: tuple  # device index, scope and dtype: storages of different kinds are never shared
    last_use: int
    shareable: bool = True


@dataclass
class _SharedStorage:
    head: _Storage
    terms: list[tirx.PrimExpr]  # the size is their max: the members' sizes that no other covers
    busy_until: int = 0
    members: list[_Storage] = field(default_factory=list)

    @property
    def size(self) -> tirx.PrimExpr:
        return functools.reduce(tirx.max, self.terms)

    def take(self, storage: _Storage, sizes: _Sizes) -> None:
        if not any(sizes.covers(term, storage.size) for term in self.terms):
            self.terms = [term for term in self.terms if not sizes.covers(storage.size, term)]
            self.terms.append(storage.size)
        self.members.append(storage)
        self.busy_until = max(self.busy_until, storage.last_use)


def _storages_of_block(bindings, used_after: set[relax.Var]) -> dict[relax.Var, _Storage]:
    """Each storage the block allocates, with the position of the last binding that may read
    memory in it: through a tensor allocated in it, or any value made from one (a reshape is a
    view, a tuple holds its fields), counted conservatively as every value that names one, except
    that a tuple's field holds only that field's storages."""
    storages: dict[relax.Var, _Storage] = {}
    holders: dict[relax.Var, set[relax.Var]] = {}
    field_holders: dict[relax.Var, list[set[relax.Var]]] = {}

    def held_by(expr: relax.Expr) -> set[relax.Var]:
        return set().union(*(holders.get(var, set()) for var in relax.analysis.free_vars(expr)))

    for position, binding in enumerate(bindings):
        value = binding.value
        if op_key(value) == "relax.memory.alloc_storage":
            (size,) = value.args[0].values
            kind = (int(value.args[1].value), value.args[2].value, str(value.args[3].value))
            storages[binding.var] = _Storage(binding.var, position, size, kind, last_use=position)
            holders[binding.var] = {binding.var}
            continue
        for var in relax.analysis.free_vars(value):
            if var in storages and not (op_key(value) == "relax.memory.alloc_tensor" and value.args[0].same_as(var)):
                storages[var].shareable = False  # read some other way than as a tensor's home
        if isinstance(value, relax.TupleGetItem) and value.tuple_value in field_holders:
            held = field_holders[value.tuple_value][value.index]
        else:
            held = held_by(value)
        if isinstance(value, relax.Tuple):
            field_holders[binding.var] = [held_by(field) for field in value.fields]
        for storage_var in held:
            storages[storage_var].last_use = position
        holders[binding.var] = held
    for var in used_after:
        for storage_var in holders.get(var, ()):
            storages[storage_var].shareable = False
    return storages


def _share(storages: list[_Storage], sizes: _Sizes) -> dict[relax.Var, _SharedStorage]:
    """Assign each storage, in allocation order, to a shared storage: a free one where possible."""
    shared: list[_SharedStorage] = []
    owner: dict[relax.Var, _SharedStorage] = {}
    for storage in storages:
        free = []
        if storage.shareable and sizes.known_at_entry(storage.size):
            free = [group for group in shared
                    if group.busy_until < storage.position and group.head.kind == storage.kind
                    and len(group.terms) < MAX_SIZE_TERMS]
        if free:
            wanted = sizes.nominal(storage.size)
            fitting = [group for group in free if sizes.nominal(group.size) >= wanted]
            group = (min(fitting, key=lambda g: sizes.nominal(g.size)) if fitting
                     else max(free, key=lambda g: sizes.nominal(g.size)))
        else:
            group = _SharedStorage(storage, terms=[])
            if storage.shareable:
                shared.append(group)
        group.take(storage, sizes)
        owner[storage.var] = group
    return owner


def _rewrite_block(block: relax.BindingBlock, used_after: set[relax.Var], sizes: _Sizes) -> relax.BindingBlock:
    bindings = list(block.bindings)
    storages = _storages_of_block(bindings, used_after)
    owner = _share(sorted(storages.values(), key=lambda s: s.position), sizes)
    rewritten = []
    for binding in bindings:
        value = binding.value
        if binding.var in owner:
            group = owner[binding.var]
            if not group.head.var.same_as(binding.var):
                continue  # a tensor's home is now the shared storage, allocated earlier
            if len(group.members) > 1:
                sized = relax.ShapeExpr([group.size])
                value = relax.Call(value.op, [sized, *value.args[1:]], value.attrs, value.ty_args)
        elif op_key(value) == "relax.memory.alloc_tensor" and value.args[0] in owner:
            home = owner[value.args[0]].head.var
            value = relax.Call(value.op, [home, *value.args[1:]], value.attrs, value.ty_args)
        rewritten.append(relax.VarBinding(binding.var, value) if isinstance(binding, relax.VarBinding)
                         else relax.MatchCast(binding.var, value, binding.ty))
    return type(block)(rewritten)


def _rewrite_seq(seq: relax.SeqExpr, sizes: _Sizes) -> relax.SeqExpr:
    blocks = []
    for index, block in enumerate(seq.blocks):
        block = type(block)([_rewrite_nested(binding, sizes) for binding in block.bindings])
        later = relax.SeqExpr(list(seq.blocks[index + 1:]), seq.body)
        blocks.append(_rewrite_block(block, set(relax.analysis.free_vars(later)), sizes))
    return relax.SeqExpr(blocks, seq.body)


def _rewrite_nested(binding, sizes: _Sizes):
    """The branches of an `If` are blocks of their own: share storages inside each."""
    value = binding.value
    if not isinstance(value, relax.If):
        return binding
    branched = relax.If(value.cond, _rewrite_seq(value.true_branch, sizes),
                        _rewrite_seq(value.false_branch, sizes))
    return relax.VarBinding(binding.var, branched)


def storage_sizes(seq: relax.SeqExpr) -> list[tirx.PrimExpr]:
    """The size in bytes of every storage `seq` allocates, `If` branches included."""
    sizes = []
    for block in seq.blocks:
        for binding in block.bindings:
            value = binding.value
            if op_key(value) == "relax.memory.alloc_storage":
                sizes.append(value.args[0].values[0])
            elif isinstance(value, relax.If):
                sizes += storage_sizes(value.true_branch) + storage_sizes(value.false_branch)
    return sizes


@tvm.transform.module_pass(opt_level=0, name="tightfit.ShareSymbolicStorage")
class ShareSymbolicStorage:
    """Rewrites each Relax function's storages as above, and records the sizes of those left in
    its STORAGE_BYTES_ATTR attribute (as text: the compile report lists them)."""

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        builder = relax.BlockBuilder(mod)
        for global_var, func in mod.functions.items():
            if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
                continue
            body = _rewrite_seq(func.body, _Sizes(func))
            rewritten = relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span)
            rewritten = rewritten.with_attr(STORAGE_BYTES_ATTR, [describe_dim(size) for size in storage_sizes(body)])
            builder.update_func(global_var, builder.normalize(rewritten))
        return builder.get()
