"""Fold calls whose arguments are all constants with numpy, instead of compiling each one.

SoD2 §4.1: RDP is a (symbolic) constant propagation over the graph; its concrete part, values
known at compile time, is classical constant folding. TVM's FoldConstant folds a call on
constants by legalizing it, compiling it with LLVM and running it: 10-40 ms a call. Exported
models are full of such calls on scalars and shapes. Every Clip of a PyTorch export guards its
bounds against NaN (`where(isnan(c), -inf, c)`): 140 calls in MobileNetV2, 5.6 s of a 44 s
compile. ONNX's expanded Attention computes its scale from the query's shape: 34 calls, 1.3 s
of a 1.8 s compile.

This pass evaluates those calls with numpy, for the ops where numpy computes exactly what TVM's
kernel computes: IEEE float arithmetic (+ - * / and sqrt, each correctly rounded), integer
arithmetic (wrapping), comparisons, logic, casts, layout ops, integer ranges, and indexing
(take, and scatter_elements with its updates applied in the kernel's order). A result is kept
only when its shape and dtype are the ones TVM inferred for the call. Bindings to a folded value
are replaced by the constant at every use, so chains fold in one walk. Everything else is left
to FoldConstant (one call at a time, fold_constant_calls.py, which folds with numpy first too:
its own folds make new calls on constants): ops whose last bits depend on the math library (exp,
pow), sums (their order rounds), integer division by zero, and ops not in EVALUATORS. The shape
of a tensor of static shape (`shape_of`) is folded too: shape computations start from it.
Limit: values that reach a call through `match_cast` or `vm.builtin.tensor_to_shape` (shapes
computed as tensors, then bound to symbolic dims, as in ONNX Attention's causal mask) are not
followed.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tvm
from tvm import relax

# Above this many elements a fold is left to FoldConstant: the constant would be stored in the
# package instead of computed from a smaller one, which is FoldConstant's trade-off to make.
MAX_FOLDED_ELEMENTS = 1 << 16
# A scatter folds in a Python loop, 2-3 us an update: 4096 of them cost what compiling takes.
MAX_SCATTERED_UPDATES = 1 << 12


def _binary(function: Callable) -> Callable:
    return lambda call, a, b: function(a, b)


def _unary(function: Callable) -> Callable:
    return lambda call, a: function(a)


def _divide(call, a, b):
    """TVM divides integers as C does, truncating toward zero (numpy floors); a zero divisor
    is left to the kernel."""
    if a.dtype.kind == "f":
        return np.divide(a, b)
    if not np.all(b):
        return None
    quotient = np.abs(a) // np.abs(b)
    return np.where((a < 0) != (b < 0), -quotient, quotient).astype(a.dtype)


def _reduce(function: Callable) -> Callable:
    def reduce(call, data):
        axis = None if call.attrs.axis is None else tuple(int(a) for a in call.attrs.axis)
        return function(data, axis=axis, keepdims=bool(call.attrs.keepdims))
    return reduce


def _int_only(function: Callable) -> Callable:
    """`function` on integers only: numpy's float floor division and remainder are computed
    through fmod and may differ in the last bit from TVM's floor(a / b)."""
    return lambda call, a, b: function(a, b) if a.dtype.kind in "iu" else None


def _permute_dims(call, data):
    axes = call.attrs.axes
    return np.transpose(data, None if axes is None else [int(axis) for axis in axes])


def _squeeze(call, data):
    axis = call.attrs.axis
    return np.squeeze(data, None if axis is None else tuple(int(a) for a in axis))


def _concat(call, tensors):
    if call.attrs.axis is None:
        return None
    return np.concatenate(tensors, axis=int(call.attrs.axis))


def _take(call, data, indices):
    """TVM's take: "clip" clamps an index into range, "wrap" takes it modulo the axis; the other
    modes read out of bounds (or give NaN there), so only in-range indices fold."""
    axis = call.attrs.axis
    if axis is None:
        data, axis = data.ravel(), 0
    axis = int(axis) % data.ndim
    extent = data.shape[axis]
    mode = str(call.attrs.mode)
    if extent == 0:
        return None
    if mode == "clip":
        indices = np.clip(indices, 0, extent - 1)
    elif mode == "wrap":
        indices = np.mod(indices, extent)
    elif not np.all((indices >= 0) & (indices < extent)):
        return None
    return np.take(data, indices, axis=axis)


def _integer_arange(call, start, end, step):
    """A float arange rounds `start + i * step` as the kernel's code does (perhaps fused into
    one FMA): only integer ranges fold."""
    dtype = str(call.attrs.dtype)
    if np.dtype(dtype).kind not in "iu" or step == 0:
        return None
    return np.arange(start, end, step, dtype=dtype)


# TVM's max and min are selects on a comparison: with a NaN they give the second operand
def _select_max(a, b):
    return np.where(a > b, a, b)


def _select_min(a, b):
    return np.where(a < b, a, b)


SCATTER_REDUCTIONS: dict[str, Callable] = {
    "update": lambda old, new: new, "add": np.add, "mul": np.multiply,
    "min": _select_min, "max": _select_max,
}


def _scatter_elements(call, data, indices, updates):
    """The scatter kernel (schedules/scatter_elements.py) applies the updates one at a time, in
    the indices' row-major order (a negative index counts from the end); so does this loop, which
    makes duplicate indices and float sums come out as the kernel's. An index outside the data
    writes out of bounds in the kernel: it is not folded, nor are more updates than compiling
    the kernel costs."""
    reduction = SCATTER_REDUCTIONS.get(str(call.attrs.reduction))
    if reduction is None or data.ndim == 0 or indices.size > MAX_SCATTERED_UPDATES:
        return None
    axis = int(call.attrs.axis) % data.ndim
    if any(indices.shape[dim] > data.shape[dim] for dim in range(data.ndim) if dim != axis):
        return None
    extent = data.shape[axis]
    positions = np.where(indices < 0, indices + extent, indices)
    if not np.all((positions >= 0) & (positions < extent)):
        return None
    result = data.copy()
    for index in np.ndindex(indices.shape):
        target = (*index[:axis], positions[index], *index[axis + 1:])
        result[target] = reduction(result[target], updates[index])
    return result


EVALUATORS: dict[str, Callable] = {
    "relax.add": _binary(np.add),
    "relax.subtract": _binary(np.subtract),
    "relax.multiply": _binary(np.multiply),
    "relax.divide": _divide,
    "relax.floor_divide": _int_only(np.floor_divide),
    "relax.floor_mod": _int_only(np.remainder),
    "relax.maximum": _binary(_select_max),
    "relax.minimum": _binary(_select_min),
    "relax.equal": _binary(np.equal),
    "relax.not_equal": _binary(np.not_equal),
    "relax.less": _binary(np.less),
    "relax.less_equal": _binary(np.less_equal),
    "relax.greater": _binary(np.greater),
    "relax.greater_equal": _binary(np.greater_equal),
    "relax.logical_and": _binary(np.logical_and),
    "relax.logical_or": _binary(np.logical_or),
    "relax.logical_xor": _binary(np.logical_xor),
    "relax.logical_not": _unary(np.logical_not),
    "relax.negative": _unary(np.negative),
    "relax.abs": _unary(np.abs),
    "relax.sqrt": _unary(np.sqrt),
    "relax.floor": _unary(np.floor),
    "relax.ceil": _unary(np.ceil),
    "relax.isnan": _unary(np.isnan),
    "relax.isinf": _unary(np.isinf),
    "relax.isfinite": _unary(np.isfinite),
    # max and min of any order are exact; sums are not (the kernel's order rounds differently)
    "relax.max": _reduce(np.max),
    "relax.min": _reduce(np.min),
    "relax.where": lambda call, condition, a, b: np.where(condition, a, b),
    "relax.astype": lambda call, data: data.astype(str(call.attrs.dtype)),
    "relax.reshape": lambda call, data, shape: np.reshape(data, shape),
    "relax.broadcast_to": lambda call, data, shape: np.broadcast_to(data, shape),
    "relax.permute_dims": _permute_dims,
    "relax.expand_dims": lambda call, data: np.expand_dims(data, tuple(int(a) for a in call.attrs.axis)),
    "relax.squeeze": _squeeze,
    "relax.concat": _concat,
    "relax.shape_to_tensor": lambda call, shape: np.array(shape, dtype="int64"),
    "relax.arange": _integer_arange,
    "relax.take": _take,
    "relax.scatter_elements": _scatter_elements,
}


@relax.expr_functor.mutator
class _HostFolder(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.folded: dict[relax.Var, relax.Expr] = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = self.visit_expr(binding.value)
        if _is_known(value) and isinstance(binding.value, relax.Call):
            self.folded[binding.var] = value
        # the binding stays until remove_all_unused sees that every use took the constant
        self.builder_.emit_normalized(relax.VarBinding(binding.var, value))

    def visit_var_(self, var: relax.Var) -> relax.Expr:
        return self.folded.get(var, var)

    def visit_dataflow_var_(self, var: relax.Var) -> relax.Expr:
        return self.folded.get(var, var)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.builder_.normalize(super().visit_call_(call))
        return fold_on_host(call) or call


def fold_on_host(call: relax.Call) -> relax.Expr | None:
    """The constant `call` evaluates to, when every argument is a constant and numpy computes
    this op exactly as TVM does; else None."""
    if not isinstance(call.op, tvm.ir.Op):
        return None
    if call.op.name == "relax.shape_of":
        shape = _tensor_shape(call.args[0])
        return shape if shape is not None and _static_shape(shape.values) is not None else None
    if call.op.name not in EVALUATORS:
        return None
    expected = _tensor_shape(call)
    if expected is None:
        return None
    shape = _static_shape(expected.values)
    if shape is None or int(np.prod(shape)) > MAX_FOLDED_ELEMENTS:
        return None
    arguments = [_host_value(argument) for argument in call.args]
    if any(argument is None for argument in arguments):
        return None
    with np.errstate(all="ignore"):  # inf and nan are values like any other here
        result = EVALUATORS[call.op.name](call, *arguments)
    if result is None:
        return None
    result = np.asarray(result)
    dtype = str(call.ty.dtype)
    if list(result.shape) != shape or str(result.dtype) != dtype:
        return None
    return relax.const(result.copy(order="C"), dtype)


def _host_value(expr: relax.Expr):
    """A constant argument as numpy sees it: an array, a tuple of ints (a shape), a list of
    arrays (a tuple of tensors), an int (a scalar); None when it is not known at compile time."""
    if isinstance(expr, tvm.ir.GenericConst):
        return expr.value.numpy()
    if isinstance(expr, tvm.tirx.IntImm):  # a scalar argument is the TIR expression itself
        return int(expr.value)
    if isinstance(expr, relax.ShapeExpr):
        return _static_shape(expr.values)
    if isinstance(expr, relax.Tuple):
        fields = [_host_value(field) for field in expr.fields]
        return None if any(not isinstance(field, np.ndarray) for field in fields) else fields
    return None


def _tensor_shape(expr: relax.Expr) -> relax.ShapeExpr | None:
    """The shape TVM inferred for a tensor `expr`, when it is spelled out."""
    ty = expr.ty
    if isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr):
        return ty.shape
    return None


def _is_known(expr: relax.Expr) -> bool:
    return isinstance(expr, tvm.ir.GenericConst) or (
        isinstance(expr, relax.ShapeExpr) and _static_shape(expr.values) is not None)


def _static_shape(values) -> list[int] | None:
    if not all(isinstance(value, tvm.tirx.IntImm) for value in values):
        return None
    return [int(value) for value in values]


@tvm.transform.module_pass(opt_level=0, name="tightfit.FoldConstantsOnHost")
class FoldConstantsOnHost:
    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        updated = mod.clone()
        for global_var, func in mod.functions.items():
            if isinstance(func, relax.Function):
                folded = _HostFolder(mod).visit_expr(func)
                updated[global_var] = relax.analysis.remove_all_unused(folded)
        return updated
