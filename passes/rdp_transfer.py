"""RDP's transfer functions, forward and backward, for shapes and for values (SoD2 §4.1, Table 3).

SoD2 has one Update function per class × direction × (shape, value); here each is a family of op
rules, keyed by the op's class (passes/classify_dynamism.py):
- forward shape, ISDOS: Relax's own shape inference (`FInferType`) run again on the *refined*
  argument facts (unknown dims become fresh placeholder symbols that map back to NAC), plus rules
  Relax lacks: broadcasting against a dim that cannot be 1 (`[n,16] + [5,16]` is `[5,16]`);
- forward shape, ISVDOS: the same, with each shape-giving argument replaced by the values RDP
  knows for it (a `Reshape` to a computed shape gets its dims);
- forward shape, EDO: the rank and whatever dims execution cannot change (NonZero: `(rank, nac)`);
- forward value, ISDO: `shape_of`, `shape_to_tensor`, `ones`/`zeros`/`arange` of known shapes;
- forward value, ISDOS: integer arithmetic, comparisons, `where`, `take`, slicing, concatenation,
  reshapes and reductions of shape-carrying tensors, on numpy arrays of TIR expressions;
- backward shape: per op family — elementwise ops share the output's shape, broadcasting fixes an
  input dim whose partners are all 1, `matmul` ties the contracted dims and passes the outer ones
  back, `reshape` solves one unknown input dim from the element count, `concat` passes the
  non-axis dims back and solves one unknown axis length, and layout ops map dims back;
- backward value, ISVDOS: the output shape of `reshape`/`broadcast_to`/`ones`/… *is* the value
  of its shape argument; `tensor_to_shape` and value-preserving reshapes carry values back.
`match_cast` binds a cut symbol forward (solving it when the input dim is known) and passes its
pattern back; `If` is handled by the engine (Merge). Anything without a rule gets Relax's own type
and nothing else — never a guess.
"""

from __future__ import annotations

from dataclasses import replace
from functools import reduce

import numpy as np
import tvm
from tvm import relax, tirx

from .rdp_lattice import (MAX_VALUE_ELEMENTS, NAC, OBJECT_FACT, UNDEF, UNDEF_FACT, Fact,
                          SymbolTable, is_expr, prim_fact, shape_fact, tensor_fact, tuple_fact,
                          unknown_rank_tensor)


def int64(value) -> tirx.IntImm:
    return tirx.IntImm("int64", int(value))


def fact_from_type(ty) -> Fact:
    """What a Relax type says: Relax's own (forward) inference, SoD2's starting point here."""
    if isinstance(ty, relax.TensorType):
        dtype = str(ty.dtype)
        shape = ty.shape
        if isinstance(shape, relax.ShapeExpr):
            return tensor_fact(shape.values, dtype)
        if shape is not None and isinstance(shape.ty, relax.ShapeType) and shape.ty.values is not None:
            return tensor_fact(shape.ty.values, dtype)
        return tensor_fact([NAC] * ty.ndim, dtype) if ty.ndim >= 0 else unknown_rank_tensor(dtype)
    if isinstance(ty, relax.ShapeType):
        if ty.values is not None:
            return shape_fact(ty.values)
        return Fact("shape", ty.ndim, (), (NAC,) * ty.ndim) if ty.ndim >= 0 else Fact("shape", NAC)
    if isinstance(ty, tvm.ir.PrimType):
        return prim_fact(NAC, str(ty.dtype))
    if isinstance(ty, relax.TupleType):
        return tuple_fact(fact_from_type(field) for field in ty.fields)
    return OBJECT_FACT


def _is_integer(dtype: str) -> bool:
    return dtype.startswith(("int", "uint")) or dtype == "bool"


def _element(value, dtype: str):
    if dtype == "bool":
        return tirx.IntImm("bool", int(bool(value)))
    return int64(value)


def constant_fact(const) -> Fact:
    array = const.value.numpy()
    dtype = str(array.dtype)
    values = None
    if _is_integer(dtype) and array.size <= MAX_VALUE_ELEMENTS:
        values = [_element(v, dtype) for v in array.reshape(-1).tolist()]
    return tensor_fact([int64(d) for d in array.shape], dtype, values)


class Env:
    """What the transfer functions read: the facts so far and the symbol table."""

    def __init__(self, symbols: SymbolTable, facts: dict):
        self.symbols = symbols
        self.facts = facts
        self.builder = relax.BlockBuilder()

    def fact(self, expr) -> Fact:
        if isinstance(expr, relax.Var) and expr in self.facts:
            return self.facts[expr]
        if isinstance(expr, tvm.ir.GenericConst):
            return constant_fact(expr)
        if isinstance(expr, relax.ShapeExpr):
            return shape_fact(expr.values)
        if is_expr(expr):
            return prim_fact(expr, str(expr.ty.dtype))
        if isinstance(expr, relax.Tuple):
            return tuple_fact(self.fact(field) for field in expr.fields)
        if isinstance(expr, relax.SeqExpr):
            return self.fact(expr.body)
        ty = getattr(expr, "ty", None)
        return fact_from_type(ty) if ty is not None else OBJECT_FACT


# --- helpers on facts ------------------------------------------------------------------------------

def _known_dims(fact: Fact) -> bool:
    return fact.kind == "tensor" and isinstance(fact.rank, int)


def _constant_dims(fact: Fact) -> list[int] | None:
    if not _known_dims(fact) or not all(isinstance(d, tirx.IntImm) for d in fact.dims):
        return None
    return [int(d.value) for d in fact.dims]


def _array(fact: Fact) -> np.ndarray | None:
    """The elements of a shape-carrying tensor as a numpy object array (NAC where unknown)."""
    dims = _constant_dims(fact)
    if dims is None or int(np.prod(dims)) > MAX_VALUE_ELEMENTS or not _is_integer(fact.dtype or "int64"):
        return None
    size = int(np.prod(dims))
    values = list(fact.values) if fact.values is not None and len(fact.values) == size else [NAC] * size
    array = np.empty(size, dtype=object)
    array[:] = values
    return array.reshape(dims)


def _values_fact(array: np.ndarray, dtype: str) -> Fact:
    return tensor_fact([int64(d) for d in array.shape], dtype, list(array.reshape(-1)))


def _lift(fn, arity: int):
    def apply(*operands):
        if any(not is_expr(x) for x in operands):
            return NAC
        try:
            return fn(*operands)
        except Exception:  # mismatched dtypes and the like: no value, never a wrong one
            return NAC

    return np.frompyfunc(apply, arity, 1)


def _integer_division(name: str, symbols: SymbolTable):
    """TVM's integer `divide`/`mod` truncate; on a non-negative dividend and a positive divisor
    that is floor division, which the simplifier handles far better."""
    truncated, floored = ((tirx.truncdiv, tirx.floordiv) if name == "relax.divide"
                          else (tirx.truncmod, tirx.floormod))

    def divide(a, b):
        if symbols.prove(a >= int64(0)) and symbols.prove(b >= int64(1)):
            return floored(a, b)
        return truncated(a, b)

    return divide


_BINARY_VALUE_OPS = {
    "relax.add": lambda a, b: a + b,
    "relax.subtract": lambda a, b: a - b,
    "relax.multiply": lambda a, b: a * b,
    "relax.divide": tirx.truncdiv,  # TVM's integer divide truncates (checked on the VM)
    "relax.floor_divide": tirx.floordiv,
    "relax.mod": tirx.truncmod,
    "relax.floor_mod": tirx.floormod,
    "relax.maximum": tirx.max,
    "relax.minimum": tirx.min,
    "relax.equal": tirx.EQ,
    "relax.not_equal": tirx.NE,
    "relax.less": tirx.LT,
    "relax.less_equal": tirx.LE,
    "relax.greater": tirx.GT,
    "relax.greater_equal": tirx.GE,
    "relax.logical_and": tirx.And,
    "relax.logical_or": tirx.Or,
}
_UNARY_VALUE_OPS = {
    "relax.negative": lambda a: int64(0) - a,
    "relax.logical_not": tirx.Not,
    "relax.abs": lambda a: tirx.max(a, int64(0) - a),
}
ELEMENTWISE_UNARY = set(
    ("relax." + name for name in (
        "abs acos acosh asin asinh atan atanh astype bitwise_not ceil clip cos cosh erf exp floor "
        "isfinite isinf isnan log logical_not negative round rsqrt sigmoid sign sin sinh sqrt square "
        "tan tanh trunc nn.relu nn.gelu nn.gelu_tanh nn.silu nn.selu nn.leakyrelu nn.softplus "
        "nn.softmax nn.log_softmax nn.layer_norm nn.group_norm nn.instance_norm nn.rms_norm "
        "nn.prelu argsort sort flip tril triu zeros_like ones_like full_like eye_like dequantize "
        "quantize scatter_elements scatter_nd").split()))
BROADCASTING = set(
    ("relax." + name for name in (
        "add subtract multiply divide floor_divide floor_mod mod power maximum minimum equal "
        "not_equal less less_equal greater greater_equal logical_and logical_or logical_xor "
        "bitwise_and bitwise_or bitwise_xor left_shift right_shift atan2 where log_add_exp").split()))
# ops whose output shape is the value of their shape argument (position 1, or 0)
SHAPE_ARGUMENT = {"relax.reshape": 1, "relax.broadcast_to": 1, "relax.collapse_sum_to": 1,
                  "relax.ones": 0, "relax.zeros": 0, "relax.full": 0}
FLAT_VALUE_PRESERVING = {"relax.reshape", "relax.squeeze", "relax.expand_dims", "relax.flatten"}
_NOT_REDERIVED = {"relax.call_tir", "relax.call_pure_packed", "relax.call_dps_packed",
                  "relax.call_builtin_with_ctx", "relax.call_tir_inplace", "relax.call_inplace_packed"}


def op_name(call: relax.Call) -> str:
    if not isinstance(call.op, tvm.ir.Op):
        return ""
    name = call.op.name
    if name == "relax.call_pure_packed" and isinstance(call.args[0], relax.ExternFunc):
        if str(call.args[0].global_symbol) == "vm.builtin.tensor_to_shape":
            return "relax.tensor_to_shape"
    return name


# --- forward ---------------------------------------------------------------------------------------

def forward(binding, env: Env) -> Fact:
    """What the producer side says about `binding.var`: Relax's type, refined by the rules."""
    own = fact_from_type(binding.var.ty)
    value = binding.value
    if isinstance(binding, relax.MatchCast):
        return _match_cast_forward(binding, env)
    if isinstance(value, relax.Call):
        derived = _call_forward(value, env)
        return env.symbols.refine(own, derived, binding.var.name)
    if isinstance(value, relax.TupleGetItem):
        whole = env.fact(value.tuple_value)
        if whole.kind == "tuple" and value.index < len(whole.fields):
            return env.symbols.refine(own, whole.fields[value.index])
        return own
    return env.symbols.refine(own, env.fact(value))


def _match_cast_forward(binding: relax.MatchCast, env: Env) -> Fact:
    """A match_cast binds each fresh symbol of its pattern to the input's dim (SoD2's cut: a
    symbolic constant for the sub-graph after it) — solved when that dim is already known."""
    pattern = fact_from_type(binding.ty)
    given = env.fact(binding.value)
    return env.symbols.refine(pattern, given, binding.var.name)


def _call_forward(call: relax.Call, env: Env) -> Fact:
    name = op_name(call)
    derived = _rederive(call, env) if name and name not in _NOT_REDERIVED else UNDEF_FACT
    extra = UNDEF_FACT
    if name in BROADCASTING:
        extra = _broadcast_forward(call, env)
    elif name == "relax.nonzero":
        data = env.fact(call.args[0])
        extra = tensor_fact([int64(data.rank) if isinstance(data.rank, int) else NAC, NAC], "int64")
    elif name == "relax.shape_of":
        data = env.fact(call.args[0])
        extra = shape_fact(data.dims) if _known_dims(data) else UNDEF_FACT
    elif name == "relax.tensor_to_shape":
        data = env.fact(call.args[-1])
        dims = _constant_dims(data)
        if dims is not None and len(dims) == 1:
            values = data.values if data.values is not None else (NAC,) * dims[0]
            extra = shape_fact(values)
    fact = env.symbols.refine(derived, extra)
    values = _values_forward(call, name, env)
    if values is not None:
        fact = env.symbols.refine(fact, values)
    return fact


def _rederive(call: relax.Call, env: Env) -> Fact:
    """Relax's own inference for this op, on the argument facts RDP holds now."""
    placeholders: list = []
    changed = False

    def placeholder_for(dim):
        if is_expr(dim):
            return dim
        fresh = tirx.Var(f"rdp_unknown{len(placeholders)}", "int64")
        placeholders.append(fresh)
        return fresh

    def argument(arg):
        nonlocal changed
        if isinstance(arg, relax.Tuple):
            return relax.Tuple([argument(field) for field in arg.fields])
        if not isinstance(arg, relax.Var) or arg not in env.facts:
            return arg
        fact = env.facts[arg]
        if fact.kind == "tensor" and isinstance(fact.rank, int) and isinstance(arg.ty, relax.TensorType):
            refined = relax.TensorType([placeholder_for(d) for d in fact.dims], arg.ty.dtype)
            changed = True
            return relax.Var(arg.name, refined)
        if fact.kind == "shape" and isinstance(fact.rank, int) and fact.values is not None:
            if any(is_expr(v) for v in fact.values):
                changed = True
                return relax.ShapeExpr([placeholder_for(v) for v in fact.values])
        if fact.kind == "prim" and fact.values and is_expr(fact.values[0]):
            changed = True
            return fact.values[0]
        return arg

    args = [argument(arg) for arg in call.args]
    if not changed:
        return UNDEF_FACT
    try:
        ty = env.builder.normalize(relax.Call(call.op, args, call.attrs, call.ty_args)).ty
    except Exception:  # Relax rejects the refined operands (e.g. mismatched known dims): no fact
        return UNDEF_FACT
    return _scrub(fact_from_type(ty), set(placeholders), env.symbols)


def _scrub(fact: Fact, placeholders: set, symbols: SymbolTable) -> Fact:
    if not placeholders:
        return fact
    if fact.kind == "tuple":
        return tuple_fact(_scrub(field, placeholders, symbols) for field in fact.fields)

    def clean(value):
        if is_expr(value) and any(var in placeholders for var in symbols.free_symbols(value)):
            return NAC
        return value

    values = None if fact.values is None else tuple(clean(v) for v in fact.values)
    return replace(fact, dims=tuple(clean(d) for d in fact.dims), values=values)


def broadcast_dim(candidates: list, symbols: SymbolTable):
    """The broadcast of aligned dims in a run that succeeds: 1s drop out; a known constant other
    than 1 wins over unknowns (they must be 1 or equal to it); otherwise all must agree."""
    not_one = [d for d in candidates if not (is_expr(d) and symbols.equal(d, int64(1)))]
    if not not_one:
        return int64(1)
    constants = {int(d.value) for d in not_one if isinstance(d, tirx.IntImm)}
    if len(constants) == 1:
        return int64(constants.pop())
    if constants or any(not is_expr(d) for d in not_one):
        return NAC
    first = not_one[0]
    return first if all(symbols.equal(first, d) for d in not_one[1:]) else NAC


def _tensor_args(call: relax.Call, env: Env) -> list[Fact]:
    return [env.fact(arg) for arg in call.args if isinstance(getattr(arg, "ty", None), relax.TensorType)]


def _broadcast_forward(call: relax.Call, env: Env) -> Fact:
    operands = _tensor_args(call, env)
    if not operands or not all(_known_dims(f) for f in operands):
        return UNDEF_FACT
    rank = max(f.rank for f in operands)
    dims = []
    for axis in range(rank):
        aligned = [f.dims[axis - (rank - f.rank)] for f in operands if axis - (rank - f.rank) >= 0]
        dims.append(broadcast_dim(aligned, env.symbols))
    return tensor_fact(dims)


# --- forward values (shape-carrying tensors) --------------------------------------------------------

def _out_dtype(call: relax.Call) -> str:
    ty = call.ty if hasattr(call, "ty") else None
    return str(ty.dtype) if isinstance(ty, relax.TensorType) else "int64"


def _static_ints(values) -> list[int] | None:
    if values is None:
        return None
    result = []
    for value in values:
        if isinstance(value, int):
            result.append(value)
        elif isinstance(value, tirx.IntImm):
            result.append(int(value.value))
        else:
            return None
    return result


def _values_forward(call: relax.Call, name: str, env: Env) -> Fact | None:
    """Element values of an integer result of at most MAX_VALUE_ELEMENTS elements."""
    dtype = _out_dtype(call)
    args = call.args
    if name == "relax.shape_to_tensor":
        shape = env.fact(args[0])
        if shape.kind == "shape" and isinstance(shape.rank, int):
            values = shape.values or (NAC,) * shape.rank
            return tensor_fact([int64(shape.rank)], "int64", values)
        return None
    if not _is_integer(dtype):
        return None
    try:
        result = _value_array(call, name, env)
    except (ValueError, IndexError, TypeError):  # shapes that numpy cannot combine: no values
        return None
    if result is not None and not isinstance(result, np.ndarray):  # numpy unwraps 0-d results
        scalar = np.empty((), dtype=object)
        scalar[()] = result
        result = scalar
    if result is None or result.size > MAX_VALUE_ELEMENTS:
        return None
    return _values_fact(result, dtype)


def _value_array(call: relax.Call, name: str, env: Env) -> np.ndarray | None:
    args, attrs = call.args, call.attrs
    arrays = [_array(env.fact(arg)) for arg in args]
    if name in _BINARY_VALUE_OPS and all(a is not None for a in arrays[:2]):
        operation = _BINARY_VALUE_OPS[name]
        if name in ("relax.divide", "relax.mod"):
            operation = _integer_division(name, env.symbols)
        return _lift(operation, 2)(arrays[0], arrays[1])
    if name in _UNARY_VALUE_OPS and arrays[0] is not None:
        return _lift(_UNARY_VALUE_OPS[name], 1)(arrays[0])
    if name == "relax.where" and all(a is not None for a in arrays[:3]):
        def select(cond, a, b):
            if isinstance(cond, tirx.IntImm):
                return a if cond.value else b
            return tirx.Select(cond, a, b)
        return _lift(select, 3)(*arrays[:3])
    if name == "relax.astype" and arrays[0] is not None:
        target = str(attrs.dtype)
        if target == "bool":
            return _lift(lambda a: tirx.NE(a, int64(0)) if str(a.ty.dtype) != "bool" else a, 1)(arrays[0])
        return _lift(lambda a: tirx.Cast("int64", a) if str(a.ty.dtype) == "bool" else a, 1)(arrays[0])
    if name == "relax.concat":  # its operands come as one tuple
        fields = env.fact(args[0]).fields
        pieces = [_array(field) for field in fields]
        if not pieces or any(p is None for p in pieces):
            return None
        return np.concatenate(pieces, axis=int(attrs.axis) if attrs.axis is not None else 0)
    source = arrays[0] if arrays else None
    if source is None:
        return _generated_values(call, name, env)
    if name in FLAT_VALUE_PRESERVING or name == "relax.broadcast_to":
        out = _constant_dims(fact_from_type(call.ty))
        if out is None:
            return None
        if name == "relax.broadcast_to":
            return np.broadcast_to(source, out)
        return source.reshape(out)
    if name == "relax.permute_dims":
        axes = None if attrs.axes is None else [int(a) for a in attrs.axes]
        return np.transpose(source, axes)
    if name == "relax.take" and arrays[1] is not None:
        indices = _static_ints(arrays[1].reshape(-1))
        if indices is None or attrs.axis is None:
            return None
        axis = int(attrs.axis)
        length = source.shape[axis]
        mode = str(attrs.mode)
        if mode == "clip":
            indices = [min(max(i, 0), length - 1) for i in indices]
        # "fast" reads out of bounds for a negative index; "wrap" counts from the end
        lowest = -length if mode == "wrap" else 0
        if length == 0 or any(not lowest <= i < length for i in indices):
            return None
        return np.take(source, np.array(indices, dtype=np.int64).reshape(arrays[1].shape), axis=axis)
    if name == "relax.strided_slice":
        axes, begins, ends = (_static_ints(arg.fields) for arg in args[1:4])
        strides = _static_ints(args[4].fields) if len(args) > 4 else [1] * len(axes or [])
        if None in (axes, begins, ends, strides) or any(stride <= 0 for stride in strides):
            return None
        index = [slice(None)] * source.ndim
        for axis, begin, end, stride in zip(axes, begins, ends, strides):
            index[axis] = slice(begin, end, stride)
        return source[tuple(index)]
    if name in ("relax.sum", "relax.prod", "relax.max", "relax.min"):
        combine = {"relax.sum": lambda a, b: a + b, "relax.prod": lambda a, b: a * b,
                   "relax.max": tirx.max, "relax.min": tirx.min}[name]
        axes = list(range(source.ndim)) if attrs.axis is None else [int(a) % source.ndim for a in attrs.axis]
        if any(source.shape[axis] == 0 for axis in axes):
            return None
        result = source
        for axis in sorted(axes, reverse=True):
            result = _lift(combine, 2).reduce(result, axis=axis, keepdims=bool(attrs.keepdims))
        return result
    if name == "relax.cumsum" and source.ndim == 1 and attrs.axis is not None and not attrs.exclusive:
        return _lift(lambda a, b: a + b, 2).accumulate(source)
    if name == "relax.scatter_elements" and arrays[1] is not None and arrays[2] is not None and source.ndim == 1:
        indices = _static_ints(arrays[1].reshape(-1))
        if indices is None or str(attrs.reduction) != "update":
            return None
        result = source.copy()
        for position, update in zip(indices, arrays[2].reshape(-1)):
            if not -len(result) <= position < len(result):
                return None
            result[position] = update
        return result
    return None


def _generated_values(call: relax.Call, name: str, env: Env) -> np.ndarray | None:
    """ISDO values: ones/zeros/full/arange of known shapes and bounds."""
    if name in ("relax.ones", "relax.zeros", "relax.full"):
        shape = env.fact(call.args[0])
        dims = _static_ints(shape.values) if shape.kind == "shape" else None
        if dims is None or int(np.prod(dims)) > MAX_VALUE_ELEMENTS:
            return None
        if name == "relax.full":
            fill = _array(env.fact(call.args[1]))
            if fill is None or fill.size != 1:
                return None
            element = fill.reshape(-1)[0]
        else:
            element = int64(1 if name == "relax.ones" else 0)
        array = np.empty(dims, dtype=object)
        array[...] = element
        return array
    if name == "relax.arange":
        bounds = _static_ints([env.fact(arg).values[0] if env.fact(arg).kind == "prim" and env.fact(arg).values else None
                               for arg in call.args])
        if bounds is None or len(bounds) != 3 or bounds[2] == 0:
            return None
        values = list(range(*bounds))
        if len(values) > MAX_VALUE_ELEMENTS:
            return None
        array = np.empty(len(values), dtype=object)
        array[:] = [int64(v) for v in values]
        return array
    return None


# --- backward --------------------------------------------------------------------------------------

def backward(binding, out: Fact, env: Env) -> list[tuple[relax.Var, Fact]]:
    """What the consumer side says about the inputs of `binding`, given its output fact `out`."""
    value = binding.value
    if isinstance(binding, relax.MatchCast):
        return _to_var(value, replace(out, dtype=""))
    if isinstance(value, relax.Var):
        return _to_var(value, out)
    if isinstance(value, relax.TupleGetItem):
        whole = env.fact(value.tuple_value)
        if whole.kind == "tuple" and value.index < len(whole.fields):
            fields = [UNDEF_FACT] * len(whole.fields)
            fields[value.index] = out
            return _to_var(value.tuple_value, tuple_fact(fields))
        return []
    if isinstance(value, relax.Tuple):
        if out.kind != "tuple":
            return []
        return [pair for field, fact in zip(value.fields, out.fields) for pair in _to_var(field, fact)]
    if isinstance(value, relax.Call):
        return _call_backward(value, out, env)
    return []


def _to_var(expr, fact: Fact) -> list:
    return [(expr, fact)] if isinstance(expr, relax.Var) and fact.kind != "undef" else []


def _partial(rank: int, known: dict) -> Fact:
    return tensor_fact([known.get(axis, UNDEF) for axis in range(rank)])


def _call_backward(call: relax.Call, out: Fact, env: Env) -> list:
    name = op_name(call)
    args = call.args
    result: list = []
    if name in SHAPE_ARGUMENT and _known_dims(out):
        position = SHAPE_ARGUMENT[name]
        result += _to_var(args[position], shape_fact(out.dims))
    if name == "relax.tensor_to_shape" and out.kind == "shape" and out.values is not None:
        result += _to_var(args[-1], tensor_fact([int64(len(out.values))], "", out.values))
    if name == "relax.shape_to_tensor" and out.values is not None:
        result += _to_var(args[0], shape_fact(out.values))
    if name == "relax.shape_of" and out.kind == "shape" and out.values is not None:
        result += _to_var(args[0], tensor_fact(out.values))
    if not _known_dims(out):
        return result
    if name in ELEMENTWISE_UNARY and not _flattens(call, name):
        values = out.values if name == "relax.astype" and _widening(call, env) else None
        result += _to_var(args[0], tensor_fact(out.dims, values=values))
    elif name == "relax.gather_elements":
        result += _to_var(args[1], tensor_fact(out.dims))
    elif name in BROADCASTING:
        result += _broadcast_backward(call, out, env)
    elif name == "relax.matmul":
        result += _matmul_backward(call, out, env)
    elif name in FLAT_VALUE_PRESERVING:
        result += _reshape_backward(call, name, out, env)
    elif name == "relax.concat":
        result += _concat_backward(call, out, env)
    elif name == "relax.permute_dims":
        axes = list(range(out.rank))[::-1] if call.attrs.axes is None else [int(a) for a in call.attrs.axes]
        result += _to_var(args[0], _partial(out.rank, {axis: out.dims[i] for i, axis in enumerate(axes)}))
    elif name == "relax.take" and call.attrs.axis is not None:
        result += _take_backward(call, out, env)
    elif name == "relax.strided_slice" or name.startswith(("relax.nn.conv", "relax.nn.max_pool",
                                                                              "relax.nn.avg_pool", "relax.nn.adaptive")):
        result += _batch_and_unsliced_backward(call, name, out)
    elif name in ("relax.sum", "relax.mean", "relax.max", "relax.min", "relax.prod", "relax.variance",
                  "relax.std", "relax.argmax", "relax.argmin"):
        result += _reduction_backward(call, out, env)
    return result


def _flattens(call: relax.Call, name: str) -> bool:
    return name in ("relax.cumsum", "relax.cumprod", "relax.argsort", "relax.sort") and getattr(call.attrs, "axis", 0) is None


def _widening(call: relax.Call, env: Env) -> bool:
    source = env.fact(call.args[0]).dtype
    return source in ("int32", "int64") and str(call.attrs.dtype) == "int64"


def _broadcast_backward(call: relax.Call, out: Fact, env: Env) -> list:
    operands = [(arg, env.fact(arg)) for arg in call.args if isinstance(getattr(arg, "ty", None), relax.TensorType)]
    if not all(_known_dims(f) for _, f in operands):
        return []
    result = []
    for index, (arg, fact) in enumerate(operands):
        known = {}
        for axis in range(fact.rank):
            out_axis = axis + out.rank - fact.rank
            target = out.dims[out_axis] if 0 <= out_axis < out.rank else UNDEF
            if not is_expr(target):
                continue
            partners = [other.dims[out_axis - (out.rank - other.rank)]
                        for j, (_, other) in enumerate(operands)
                        if j != index and out_axis - (out.rank - other.rank) >= 0]
            # every partner is 1 (or absent): this operand alone gives the output dim
            if all(is_expr(p) and env.symbols.equal(p, int64(1)) for p in partners):
                known[axis] = target
            elif env.symbols.equal(target, int64(1)):
                known[axis] = int64(1)
        if known:
            result += _to_var(arg, _partial(fact.rank, known))
    return result


def _matmul_backward(call: relax.Call, out: Fact, env: Env) -> list:
    a, b = env.fact(call.args[0]), env.fact(call.args[1])
    if not (_known_dims(a) and _known_dims(b)) or a.rank < 1 or b.rank < 1:
        return []
    result = []
    contracted_a, contracted_b = a.dims[-1], b.dims[-2] if b.rank >= 2 else b.dims[0]
    # the contracted dims are one dim: each tells the other
    result += _to_var(call.args[0], _partial(a.rank, {a.rank - 1: contracted_b}))
    result += _to_var(call.args[1], _partial(b.rank, {b.rank - 2 if b.rank >= 2 else 0: contracted_a}))
    if a.rank >= 2 and out.rank >= 2:
        row = out.dims[-2] if b.rank >= 2 else out.dims[-1]
        result += _to_var(call.args[0], _partial(a.rank, {a.rank - 2: row}))
    if b.rank >= 2:
        result += _to_var(call.args[1], _partial(b.rank, {b.rank - 1: out.dims[-1]}))
    return result


def _product(dims):
    return reduce(lambda x, y: x * y, dims, int64(1))


def _reshape_backward(call: relax.Call, name: str, out: Fact, env: Env) -> list:
    """One unknown input dim of a reshape follows from the element count (input and output hold
    the same elements); element values carry over unchanged in row-major order."""
    data = env.fact(call.args[0])
    result = []
    if out.values is not None and data.kind == "tensor":
        result += _to_var(call.args[0], replace(data, values=out.values) if _known_dims(data) else UNDEF_FACT)
    if not _known_dims(data) or not all(is_expr(d) for d in out.dims):
        return result
    unknown = [axis for axis, d in enumerate(data.dims) if not is_expr(d) or env.symbols.needs_cut(d)]
    if len(unknown) != 1:
        return result
    others = _product([d for axis, d in enumerate(data.dims) if axis != unknown[0]])
    if not env.symbols.prove(others >= int64(1)):
        return result  # a zero-size dim would leave the unknown one free
    solved = tirx.floordiv(_product(out.dims), others)
    return result + _to_var(call.args[0], _partial(data.rank, {unknown[0]: env.symbols.normalize(solved)}))


def _concat_backward(call: relax.Call, out: Fact, env: Env) -> list:
    if not isinstance(call.args[0], relax.Tuple) or call.attrs.axis is None:
        return []
    fields = list(call.args[0].fields)
    facts = [env.fact(field) for field in fields]
    if not all(_known_dims(f) and f.rank == out.rank for f in facts):
        return []
    axis = int(call.attrs.axis) % out.rank
    result = []
    lengths = [f.dims[axis] for f in facts]
    missing = [i for i, d in enumerate(lengths) if not is_expr(d) or env.symbols.needs_cut(d)]
    for i, (field, fact) in enumerate(zip(fields, facts)):
        known = {k: out.dims[k] for k in range(out.rank) if k != axis}
        if missing == [i] and is_expr(out.dims[axis]):
            rest = [d for j, d in enumerate(lengths) if j != i]
            known[axis] = env.symbols.normalize(out.dims[axis] - reduce(lambda x, y: x + y, rest, int64(0)))
        result += _to_var(field, _partial(out.rank, known))
    return result


def _take_backward(call: relax.Call, out: Fact, env: Env) -> list:
    data, indices = env.fact(call.args[0]), env.fact(call.args[1])
    if not (_known_dims(data) and _known_dims(indices)) or out.rank != data.rank - 1 + indices.rank:
        return []
    axis = int(call.attrs.axis) % data.rank
    outer = {k: out.dims[k] for k in range(axis)}
    outer.update({k: out.dims[k - 1 + indices.rank] for k in range(axis + 1, data.rank)})
    return (_to_var(call.args[0], _partial(data.rank, outer))
            + _to_var(call.args[1], tensor_fact(out.dims[axis:axis + indices.rank])))


def _batch_and_unsliced_backward(call: relax.Call, name: str, out: Fact) -> list:
    data_rank = out.rank
    if name == "relax.strided_slice":
        axes = _static_ints(call.args[1].fields) if isinstance(call.args[1], relax.Tuple) else None
        sliced = set(range(data_rank) if axes is None else axes)
        return _to_var(call.args[0], _partial(data_rank, {k: out.dims[k] for k in range(data_rank)
                                                           if k not in sliced}))
    layout = str(getattr(call.attrs, "data_layout", getattr(call.attrs, "layout", "")))
    out_layout = str(getattr(call.attrs, "out_layout", layout))
    if not layout.startswith("N") or layout != out_layout:
        return []
    return _to_var(call.args[0], _partial(data_rank, {0: out.dims[0]}))


def _reduction_backward(call: relax.Call, out: Fact, env: Env) -> list:
    data = env.fact(call.args[0])
    if not _known_dims(data) or call.attrs.axis is None:
        return []
    axis_attr = call.attrs.axis
    axes = {int(a) % data.rank for a in (axis_attr if hasattr(axis_attr, "__len__") else [axis_attr])}
    keep = bool(getattr(call.attrs, "keepdims", False))
    kept = [k for k in range(data.rank) if k not in axes]
    if keep and out.rank == data.rank:
        return _to_var(call.args[0], _partial(data.rank, {k: out.dims[k] for k in kept}))
    if not keep and out.rank == len(kept):
        return _to_var(call.args[0], _partial(data.rank, {k: out.dims[i] for i, k in enumerate(kept)}))
    return []
