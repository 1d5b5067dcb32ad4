"""The values of small integer tensors, traced back to the shapes they were computed from.

Exported models compute shapes as tensors: PyTorch's `x.reshape(b, t // 4, 3, -1)` becomes
Shape → Gather → Div → Unsqueeze → Concat → Reshape, and the dynamo exporter does the arithmetic
on int64 tensors. TVM's importer folds some of these patterns into `ShapeExpr`s, but as soon as one
step is emitted as a tensor op the result is just "an int64 tensor of length 4", and the Reshape
that consumes it gets a shape with no known dims. Then nothing later can be fused, planned or
proven (a slice of a dim that is really 3 becomes `min(1, d)`, which Squeeze rejects).

`shape_values` walks the Relax bindings that produced a 1-D (or 0-D) tensor and returns each
element as a TIR expression over the model's symbolic dims when it can (None for an element it
cannot). It is the import-time half of SoD2's RDP value lattice (§4.1): known constant, symbolic
expression, or unknown. The converters in `ops_shape.py` use it to keep dims symbolic; where an
element stays unknown they bind a fresh symbol checked at run time (`match_cast`).
"""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax, tirx

MAX_TRACED_LENGTH = 16  # shape vectors are short; longer tensors are data, not shapes

_ANALYZER = tvm.sym.Analyzer()


def shape_values(bb: relax.BlockBuilder, value) -> list | None:
    """The elements of a 1-D or 0-D int/float tensor (or shape, or scalar) as TIR expressions.

    Returns None when the value is not such a vector of statically known length; otherwise a list
    whose elements are int64 (or float) PrimExprs, or None where an element's value is unknown
    before the model runs. A scalar is a list of one element.
    """
    traced = _trace(bb, value, depth=0)
    if traced is None:
        return None
    return [None if element is None else _ANALYZER.simplify(element) for element in traced]


def known_ints(values: list | None) -> bool:
    """True when every element is known and is an integer expression."""
    return values is not None and all(
        element is not None and _is_int(dtype_of(element)) for element in values)


def constant_value(element) -> int | None:
    """The Python int of a constant element, None if it is symbolic or unknown."""
    return int(element.value) if isinstance(element, tirx.IntImm) else None


def same_dims_as(dims: list, pool: list) -> list:
    """`dims`, each symbolic one replaced by an expression of `pool` that has the same value.

    Traced arithmetic and Relax's shape inference write one dim in different forms: ONNX's integer
    Div truncates (`T.Div(t - 1, 4) + 1`) where a strided conv's output floors (`(t - 1) // 4 + 1`);
    they agree for every positive `t`, which the analyzer cannot prove. Equality is checked at
    sample values of the dims (all at least 1), so callers must bind the result with a
    `match_cast`, which checks it when the model runs.
    """
    candidates = [dim for dim in pool if dim is not None and not isinstance(dim, tirx.IntImm)]
    return [_same_as_one_of(dim, candidates) for dim in dims]


def _same_as_one_of(dim, candidates: list):
    if dim is None or isinstance(dim, tirx.IntImm):
        return dim
    for candidate in candidates:
        if _ANALYZER.can_prove_equal(dim, candidate) or _agree_at_samples(dim, candidate):
            return candidate
    return dim


_SAMPLE_DIMS = (1, 2, 3, 5, 8, 13, 64, 127)


def _agree_at_samples(a, b) -> bool:
    symbols = sorted({*tirx.analysis.undefined_vars(a), *tirx.analysis.undefined_vars(b)},
                     key=lambda var: var.name)
    for sample in range(len(_SAMPLE_DIMS)):
        analyzer = tvm.sym.Analyzer()
        for index, symbol in enumerate(symbols):
            analyzer.bind(symbol, tirx.IntImm(dtype_of(symbol), _SAMPLE_DIMS[(sample + 3 * index) % len(_SAMPLE_DIMS)]))
        difference = analyzer.simplify(a - b)
        if not isinstance(difference, tirx.IntImm) or difference.value != 0:
            return False
    return True


def _trace(bb, value, depth: int) -> list | None:
    if depth > 64:  # shape arithmetic is shallow; deeper chains are not worth following
        return _unknown_elements(value)
    if isinstance(value, relax.ShapeExpr):
        return list(value.values)
    if isinstance(value, tvm.ir.GenericConst):
        return _constant_elements(value)
    if isinstance(value, relax.Var):
        bound = bb.lookup_binding(value)
        if bound is not None:
            return _trace(bb, bound, depth + 1)
        if isinstance(value.ty, relax.ShapeType) and value.ty.values is not None:
            return list(value.ty.values)
        if isinstance(value.ty, tvm.ir.PrimType):
            return [_as_int64(value)] if _is_int(dtype_of(value)) else [value]
        return _unknown_elements(value)
    if tvm.ir.is_prim_expr(value) and isinstance(value.ty, tvm.ir.PrimType):
        return [_as_int64(value)] if _is_int(dtype_of(value)) else [value]
    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
        rule = _RULES.get(value.op.name)
        if rule is not None:
            traced = rule(bb, value, depth + 1)
            if traced is not None:
                return traced
    return _unknown_elements(value)


def _unknown_elements(value) -> list | None:
    """[None] * length for a vector of static length (its values unknown), else None."""
    ty = getattr(value, "ty", None)
    if isinstance(ty, relax.ShapeType):
        return None if ty.ndim < 0 else [None] * ty.ndim
    if not isinstance(ty, relax.TensorType) or ty.shape is None or ty.ndim > 1:
        return None
    if ty.ndim == 0:
        return [None]
    length = ty.shape.values[0]
    if not isinstance(length, tirx.IntImm) or length.value > MAX_TRACED_LENGTH:
        return None
    return [None] * int(length.value)


def _constant_elements(const: tvm.ir.GenericConst) -> list | None:
    array = const.value.numpy()
    if array.ndim > 1 or array.size > MAX_TRACED_LENGTH:
        return None
    if np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_:
        return [tirx.IntImm("int64", int(v)) for v in array.reshape(-1)]
    if np.issubdtype(array.dtype, np.floating):
        return [tirx.FloatImm(str(array.dtype), float(v)) for v in array.reshape(-1)]
    return None


def _is_int(dtype) -> bool:
    return str(dtype).startswith(("int", "uint", "bool"))


def dtype_of(expr) -> str:
    """The element type of a TIR expression (0.27 keeps it in the expression's type)."""
    return str(expr.ty.dtype)


def _as_int64(expr):
    return expr if dtype_of(expr) == "int64" else tirx.Cast("int64", expr)


def _elementwise(combine):
    """A rule for a broadcasting binary op: pairs the operands' elements (length 1 broadcasts)."""

    def rule(bb, call, depth):
        lhs, rhs = (_trace(bb, arg, depth) for arg in call.args[:2])
        if lhs is None or rhs is None:
            return None
        if len(lhs) != len(rhs):
            if 1 not in (len(lhs), len(rhs)):
                return None
            lhs, rhs = lhs * len(rhs) if len(lhs) == 1 else lhs, rhs * len(lhs) if len(rhs) == 1 else rhs
        result = []
        for a, b in zip(lhs, rhs):
            if a is None or b is None or _is_int(dtype_of(a)) != _is_int(dtype_of(b)):
                result.append(None)
            else:
                result.append(combine(*_same_float_type(a, b)))
        return result

    return rule


def _same_float_type(a, b):
    """Float constants meet float expressions in the expression's type (float32 mostly)."""
    if _is_int(dtype_of(a)) or dtype_of(a) == dtype_of(b):
        return a, b
    if isinstance(a, tirx.FloatImm):
        return tirx.FloatImm(dtype_of(b), a.value), b
    if isinstance(b, tirx.FloatImm):
        return a, tirx.FloatImm(dtype_of(a), b.value)
    return a, tirx.Cast(dtype_of(a), b)


def _divide(a, b):
    # ONNX (and Relax's tensor divide) truncates integer quotients toward zero.
    return tirx.truncdiv(a, b) if _is_int(dtype_of(a)) else a / b


def _unary(apply):
    def rule(bb, call, depth):
        operand = _trace(bb, call.args[0], depth)
        if operand is None:
            return None
        return [None if element is None else apply(call, element) for element in operand]

    return rule


def _astype(call, element):
    dtype = str(call.attrs.dtype)
    if _is_int(dtype):
        # Float to int truncates toward zero, as a float-to-int Cast does in TIR.
        return element if _is_int(dtype_of(element)) else tirx.Cast("int64", element)
    if dtype.startswith("float"):
        return tirx.Cast(dtype, element)
    return None


def _float_only(apply):
    return lambda call, element: None if _is_int(dtype_of(element)) else apply(element)


def _same_elements(bb, call, depth):
    """reshape / squeeze / expand_dims of a vector or scalar keep its elements in order."""
    return _trace(bb, call.args[0], depth)


def _shape_to_tensor(bb, call, depth):
    return _trace(bb, call.args[0], depth)


def _shape_of(bb, call, depth):
    ty = call.args[0].ty
    if isinstance(ty, relax.TensorType) and ty.shape is not None:
        return list(ty.shape.values)
    return None


def _size(bb, call, depth):
    """The element count of a tensor of known shape: the product of its dims (ONNX's
    LayerNormalization function, once inlined, takes the Size of a Shape: the rank)."""
    ty = call.args[0].ty
    if isinstance(ty, relax.TensorType) and ty.shape is not None:
        return [math.prod(ty.shape.values, start=tirx.IntImm("int64", 1))]
    return None


def _concat(bb, call, depth):
    pieces = call.args[0]
    if not isinstance(pieces, relax.Tuple):
        return None
    traced = [_trace(bb, piece, depth) for piece in pieces.fields]
    if any(piece is None for piece in traced):
        return None
    return [element for piece in traced for element in piece]


def _take(bb, call, depth):
    source = _trace(bb, call.args[0], depth)
    indices = _trace(bb, call.args[1], depth)
    if source is None or indices is None or call.args[0].ty.ndim > 1:
        return None
    picked = []
    for index in indices:
        position = None if index is None else _constant_int(index)
        if position is None or not -len(source) <= position < len(source):
            picked.append(None)
        else:
            picked.append(source[position])
    return picked


def _strided_slice(bb, call, depth):
    source = _trace(bb, call.args[0], depth)
    if source is None or len(call.args) < 4:
        return None
    begin, end = [_constant_int(v) for v in call.args[2]], [_constant_int(v) for v in call.args[3]]
    strides = [_constant_int(v) for v in call.args[4]] if len(call.args) > 4 else [1]
    if None in begin + end + strides or len(begin) != 1:
        return None
    return source[slice(begin[0], end[0], strides[0])]


def _where(bb, call, depth):
    condition, then_values, else_values = (_trace(bb, arg, depth) for arg in call.args)
    if condition is None or then_values is None or else_values is None:
        return None
    length = max(len(condition), len(then_values), len(else_values))
    if any(len(v) not in (1, length) for v in (condition, then_values, else_values)):
        return None
    chosen = []
    for index in range(length):
        flag, a, b = (v[index if len(v) > 1 else 0] for v in (condition, then_values, else_values))
        known_flag = None if flag is None else _constant_int(flag)
        chosen.append(None if known_flag is None else (a if known_flag else b))
    return chosen


def _comparison(compare):
    def combine(a, b):
        folded = _ANALYZER.simplify(compare(a, b))
        return tirx.IntImm("int64", int(folded.value)) if isinstance(folded, tirx.IntImm) else None

    return _elementwise(combine)


def _constant_int(element) -> int | None:
    if isinstance(element, tirx.IntImm):
        return int(element.value)
    if element is not None and tvm.ir.is_prim_expr(element):
        folded = _ANALYZER.simplify(element)
        if isinstance(folded, tirx.IntImm):
            return int(folded.value)
    return None


_RULES = {
    "relax.shape_to_tensor": _shape_to_tensor,
    "relax.shape_of": _shape_of,
    "relax.size": _size,
    "relax.astype": _unary(_astype),
    "relax.concat": _concat,
    "relax.reshape": _same_elements,
    "relax.squeeze": _same_elements,
    "relax.expand_dims": _same_elements,
    "relax.take": _take,
    "relax.strided_slice": _strided_slice,
    "relax.where": _where,
    "relax.add": _elementwise(lambda a, b: a + b),
    "relax.subtract": _elementwise(lambda a, b: a - b),
    "relax.multiply": _elementwise(lambda a, b: a * b),
    "relax.divide": _elementwise(_divide),
    "relax.floor_divide": _elementwise(lambda a, b: tirx.floordiv(a, b) if _is_int(dtype_of(a)) else tirx.floor(a / b)),
    "relax.maximum": _elementwise(tirx.max),
    "relax.minimum": _elementwise(tirx.min),
    "relax.equal": _comparison(lambda a, b: a == b),
    "relax.less": _comparison(lambda a, b: a < b),
    "relax.negative": _unary(lambda call, element: -element),
    "relax.floor": _unary(_float_only(tirx.floor)),
    "relax.ceil": _unary(_float_only(tirx.ceil)),
}
