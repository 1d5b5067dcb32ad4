"""A kernel's one-element result that the VM reads goes straight into the VM's shape heap.

SoD2 §3: an execution-determined dim (NonZero's count) is known only once the kernel that
counts has run, and an `If` on data branches on a value a kernel computed. The Relax VM reads
both from a tensor: a storage and a tensor object allocated for one number (0.25 us in TVM
0.27's VM), and for a dim a shape object built from it and matched into the shape heap, the
int64 array VMShapeLower keeps the run's symbolic dims in. MNN §3.2 (pre-allocation): the
number needs no allocation of its own. Here, right after VMShapeLower, the kernel that writes
it is called from a small PrimFunc that passes it a one-element workspace and then stores the
number, as int64, into a slot of the shape heap: the slot the dim's match would have filled,
or a new one that an `If` reads its condition from (`vm.builtin.make_prim_value`, 25 ns).

Limits: the tensor is a fresh allocation of shape () or (1,), of an integer or bool type, that
one kernel call writes and that nothing reads but a read-back into a dim stored in the heap
(not one compared with a dim already known) or an `If`'s condition; a dim read back this way
is not checked to be non-negative, as the tensor's read-back was not. The `interpreted(name)`
copy a profiler runs (vm_code.py) keeps its tensors, so each kernel is timed alone there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
from tvm import relax, tirx

from tightfit.schedules.isa import MAX_STACK_ALLOCA_BYTES
from tightfit.vm_code import INTERPRETED_SUFFIX, interpreted

from .classify_dynamism import op_key
from .launch_kernel_sequences import with_own_vars

# VMShapeLower's code for "store this dim into the heap slot that follows" (MatchShapeCode)
STORE_TO_HEAP = 1
# Marks the PrimFuncs this pass makes, which call a kernel and store its number: not kernels of
# their own (the package report does not count them).
HEAP_WRITER_ATTR = "tightfit.heap_writer"
_SCALAR_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


@tvm.transform.module_pass(opt_level=0, name="tightfit.WriteScalarsToShapeHeap")
class WriteScalarsToShapeHeap:
    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        builder = relax.BlockBuilder(mod)
        symbols = {str(f.attrs["global_symbol"]) for f in mod.functions.values()
                   if isinstance(f, relax.Function) and "global_symbol" in (f.attrs or {})}
        for global_var, func in list(mod.functions.items()):
            if (not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr)
                    or "global_symbol" not in (func.attrs or {})
                    or str(func.attrs["global_symbol"]).endswith(INTERPRETED_SUFFIX)):
                continue
            rewriting = _Rewriting.of(func, builder, mod)
            if rewriting is None:
                continue
            body = rewriting.rewrite_seq(func.body)
            if not rewriting.changed:
                continue
            # the profiler's bytecode copy is the function as it was (vm_code.py), where
            # LaunchKernelSequences has not made one already
            symbol = str(func.attrs["global_symbol"])
            copy = with_own_vars(func, mod) if interpreted(symbol) not in symbols else None
            if copy is not None:
                builder.add_func(copy.with_attr("global_symbol", interpreted(symbol)), interpreted(symbol))
            body = _with_heap_size(body, rewriting.heap, rewriting.heap_slots)
            builder.update_func(global_var, builder.normalize(relax.Function(
                func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span)))
        return builder.finalize()


@dataclass
class _Rewriting:
    builder: relax.BlockBuilder
    mod: tvm.IRModule
    heap: relax.Var
    heap_slots: int
    # each var -> the bindings whose values use it, in branches too (an If uses its condition)
    uses: dict[relax.Var, list[relax.Binding]]
    changed: bool = False

    @staticmethod
    def of(func: relax.Function, builder: relax.BlockBuilder, mod: tvm.IRModule) -> "_Rewriting | None":
        """The rewriting of `func`, or None where it has no shape heap (no symbolic dims)."""
        first_bindings = [b for block in func.body.blocks for b in block.bindings][:1]
        if not first_bindings or not _is_builtin(first_bindings[0].value, "vm.builtin.alloc_shape_heap"):
            return None
        heap_binding = first_bindings[0]
        (size,) = heap_binding.value.args[1].fields
        uses: dict[relax.Var, list[relax.Binding]] = {}
        _collect_uses(func.body, uses)
        return _Rewriting(builder, mod, heap_binding.var, int(size.value), uses)

    def rewrite_seq(self, seq: relax.SeqExpr) -> relax.SeqExpr:
        blocks = []
        for block in seq.blocks:
            bindings = list(block.bindings)
            index = 0
            while index < len(bindings):  # a condition's read is inserted as it goes
                scalar = self._scalar_read_back(bindings, index)
                if scalar is not None:
                    self._write_to_heap(bindings, scalar)
                index += 1
            bindings = [b for b in bindings if b is not None]
            for index, binding in enumerate(bindings):
                if isinstance(binding.value, relax.If):
                    value = binding.value
                    bindings[index] = relax.VarBinding(binding.var, relax.If(
                        value.cond, self.rewrite_seq(value.true_branch),
                        self.rewrite_seq(value.false_branch)))
            blocks.append(relax.BindingBlock(bindings))
        return relax.SeqExpr(blocks, seq.body)

    def _scalar_read_back(self, bindings: list, index: int) -> "_ScalarReadBack | None":
        """What reads the one-element tensor allocated at `bindings[index]`, where this pass
        can write it to the heap instead; else None."""
        binding = bindings[index]
        if binding is None or op_key(binding.value) != "relax.vm.alloc_tensor":
            return None
        storage, offset, shape, dtype, _ = binding.value.args
        if (not isinstance(shape, relax.ShapeExpr) or [int(d) for d in shape.values] not in ([], [1])
                or str(dtype.value) not in _SCALAR_DTYPES or int(offset) != 0
                or not isinstance(storage, relax.Var)):
            return None
        storage_uses = self.uses.get(storage, [])
        if any(not (use.same_as(binding) or _is_kill(use.value)) for use in storage_uses):
            return None
        scalar = _ScalarReadBack(binding, storage, storage_bindings=[
            use for use in storage_uses if not use.same_as(binding)] + [
            b for b in bindings if b is not None and b.var.same_as(storage)])
        for use in self.uses.get(binding.var, []):
            value = use.value
            if _is_kill(value):
                scalar.kills.append(use)
            elif isinstance(value, relax.If) and value.cond.same_as(binding.var):
                scalar.conditions.append(use)
            elif _is_builtin(value, "vm.builtin.tensor_to_shape"):
                if not self._dim_read_back(use, scalar):
                    return None
            elif (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.GlobalVar)
                  and isinstance(self.mod[value.op], tirx.PrimFunc) and scalar.writer is None
                  and any(arg.same_as(binding.var) for arg in value.args)
                  and all(_describable(arg) for arg in value.args)):
                scalar.writer = use
            else:
                return None
        if scalar.writer is None or (not scalar.conditions and scalar.heap_slot is None):
            return None
        # every binding to drop or rewrite is in this block (none in a branch, say a kill)
        if not all(_position(bindings, use) is not None for use in scalar.bindings_used()):
            return None
        return scalar

    def _dim_read_back(self, to_shape: relax.Binding, scalar: "_ScalarReadBack") -> bool:
        """Note the bindings of a read-back into a dim stored in a heap slot; False for one that
        does more (a second read-back, a dim compared with one known, the shape used)."""
        if scalar.heap_slot is not None:
            return False
        for use in self.uses.get(to_shape.var, []):
            value = use.value
            if _is_kill(value):
                scalar.read_back.append(use)
            elif (_is_builtin(value, "vm.builtin.match_shape") and value.args[1].same_as(self.heap)
                  and int(value.args[2]) == 1 and int(value.args[3]) == STORE_TO_HEAP):
                scalar.heap_slot = int(value.args[4])
                scalar.read_back.append(use)
            elif isinstance(use, relax.MatchCast) and not self.uses.get(use.var):
                scalar.read_back.append(use)
            else:
                return False
        scalar.read_back.append(to_shape)
        return scalar.heap_slot is not None

    def _write_to_heap(self, bindings: list, scalar: "_ScalarReadBack") -> None:
        if scalar.heap_slot is None:
            scalar.heap_slot = self.heap_slots
            self.heap_slots += 1
        writer_at = _position(bindings, scalar.writer)
        for use in [scalar.tensor, *scalar.kills, *scalar.read_back, *scalar.storage_bindings]:
            bindings[_position(bindings, use)] = None
        condition = relax.Var("condition", tvm.ir.PrimType("bool"))
        for use in scalar.conditions:
            value = use.value
            bindings[_position(bindings, use)] = relax.VarBinding(use.var, relax.If(
                condition, value.true_branch, value.false_branch))
        bindings[writer_at] = self._heap_writer_call(scalar)
        if scalar.conditions:  # read right after the kernel that writes it
            bindings.insert(writer_at + 1, relax.VarBinding(condition, relax.Call(
                relax.ExternFunc("vm.builtin.make_prim_value"),
                [self.heap, tirx.IntImm("int64", 1), tirx.IntImm("int64", scalar.heap_slot)],
                ty_args=[tvm.ir.PrimType("bool")])))
        self.changed = True

    def _heap_writer_call(self, scalar: "_ScalarReadBack") -> relax.VarBinding:
        """The call of a PrimFunc that calls the writer with a workspace for the scalar, then
        stores the scalar into its heap slot."""
        writer = scalar.writer.value
        tensor = scalar.tensor.var
        symbol = str((self.mod[writer.op].attrs or {}).get("global_symbol", writer.op.name_hint))
        dtype = str(tensor.ty.dtype)
        workspace = tirx.decl_buffer([_workspace_elements(dtype)], dtype, "scalar")
        params, arguments, passed = [], [], []
        for position, arg in enumerate(writer.args):
            if arg.same_as(tensor):
                shape = [tirx.IntImm("int64", 1)] * tensor.ty.ndim
                no_strides = tirx.reinterpret("handle", tirx.IntImm("uint64", 0))
                data = tirx.call_intrin("handle", "tirx.handle_add_byte_offset", workspace.data,
                                        tirx.IntImm("int64", 0))
                arguments.append(tirx.tvm_stack_make_array(
                    data, tirx.tvm_stack_make_shape(*shape), no_strides, len(shape),
                    tirx.const(0, dtype), tirx.IntImm("int64", 0)))
            elif isinstance(arg.ty, tvm.ir.PrimType):
                scalar_param = tirx.Var(f"scalar{position}", str(arg.ty.dtype))
                params.append(scalar_param)
                arguments.append(scalar_param)
                passed.append(arg)
            else:
                buffer = _buffer_for(arg, f"tensor{position}")
                params.append(buffer)
                arguments.append(buffer)
                passed.append(arg)
        heap = tirx.decl_buffer([tirx.Var("heap_slots", "int64")], "int64", "shape_heap")
        body = tirx.SeqStmt([
            tirx.AllocBuffer(workspace),
            tirx.Evaluate(tirx.call_cpacked(symbol, *arguments)),
            tirx.BufferStore(heap, tirx.Cast("int64", tirx.BufferLoad(workspace, [tirx.IntImm("int64", 0)])),
                             [tirx.IntImm("int64", scalar.heap_slot)])])
        func = tirx.PrimFunc(params + [heap], body).with_attrs({"tirx.is_scheduled": True,
                                                                 HEAP_WRITER_ATTR: True})
        func_var = self.builder.add_func(func, "write_scalar_to_heap")
        call = self.builder.normalize(relax.Call(func_var, passed + [self.heap]))
        return relax.VarBinding(relax.Var("_", call.ty), call)


@dataclass(eq=False)
class _ScalarReadBack:
    tensor: relax.VarBinding
    storage: relax.Var
    writer: relax.VarBinding | None = None
    kills: list = field(default_factory=list)
    conditions: list = field(default_factory=list)  # the If bindings branching on it
    read_back: list = field(default_factory=list)  # the bindings of its read-back into a dim
    heap_slot: int | None = None
    storage_bindings: list = field(default_factory=list)  # its storage's allocation and kills

    def bindings_used(self) -> list[relax.Binding]:
        return [self.tensor, self.writer, *self.kills, *self.conditions, *self.read_back,
                *self.storage_bindings]


def _position(bindings: list, binding: relax.Binding) -> int | None:
    return next((index for index, candidate in enumerate(bindings)
                 if candidate is not None and candidate.same_as(binding)), None)


def _workspace_elements(dtype: str) -> int:
    """Elements of a workspace of MAX_STACK_ALLOCA_BYTES: never a stack array, whose alignment
    the kernel's vector stores may need (see launch_kernel_sequences.py)."""
    return MAX_STACK_ALLOCA_BYTES // max(1, tvm.DataType(dtype).bits // 8)


def _buffer_for(tensor: relax.Expr, name: str) -> tirx.Buffer:
    """A buffer for a tensor passed through to the writer: its dims are read from the tensor."""
    ty = tensor.ty
    shape = [tirx.Var(f"{name}_dim{axis}", "int64") for axis in range(ty.ndim)]
    return tirx.decl_buffer(shape, ty.dtype, name)


def _describable(arg: relax.Expr) -> bool:
    ty = arg.ty
    return isinstance(ty, tvm.ir.PrimType) or (
        isinstance(arg, (relax.Var, tvm.ir.Constant, tvm.ir.GenericConst))
        and isinstance(ty, relax.TensorType) and ty.ndim >= 0 and str(ty.dtype) not in ("", "bfloat16"))


def _is_builtin(value: relax.Expr, symbol: str) -> bool:
    if not isinstance(value, relax.Call):
        return False
    op = value.op
    if isinstance(op, relax.ExternFunc):
        return op.global_symbol == symbol
    return (isinstance(op, tvm.ir.Op) and op.name == "relax.call_builtin_with_ctx"
            and isinstance(value.args[0], relax.ExternFunc) and value.args[0].global_symbol == symbol)


def _is_kill(value: relax.Expr) -> bool:
    return op_key(value) == "relax.vm.kill_object"


def _collect_uses(seq: relax.SeqExpr, uses: dict) -> None:
    for block in seq.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.If):
                for var in relax.analysis.free_vars(value.cond):
                    uses.setdefault(var, []).append(binding)
                _collect_uses(value.true_branch, uses)
                _collect_uses(value.false_branch, uses)
                continue
            for var in relax.analysis.free_vars(value):
                uses.setdefault(var, []).append(binding)
    for var in relax.analysis.free_vars(seq.body):
        uses.setdefault(var, []).append(relax.VarBinding(relax.Var("_body", var.ty), var))


def _with_heap_size(body: relax.SeqExpr, heap: relax.Var, slots: int) -> relax.SeqExpr:
    """`body` with the heap that `heap` is bound to grown to `slots` slots."""
    first_block, *rest = body.blocks
    heap_binding, *bindings = first_block.bindings
    value = heap_binding.value
    grown = relax.Call(value.op, [value.args[0], relax.Tuple([tirx.IntImm("int64", slots)])],
                       value.attrs, value.ty_args)
    return relax.SeqExpr([relax.BindingBlock([relax.VarBinding(heap, grown), *bindings]), *rest], body.body)
