"""Converters for ops whose output shape comes from the values of another input.

These are SoD2's ISVDOS ops (§3): Reshape, Expand, Tile, ConstantOfShape, Range, Slice, TopK,
Resize, Upsample. TVM 0.27's importer wants their shape-giving input to be a constant or a
`ShapeExpr` it folded at import time, and fails or loses every dim otherwise ("Reshape requires
the input new shape to be Shape", "TopK k must be a constant", `int(val.value)` on a symbolic
Resize size, an Expand that ignores ONNX's "1 keeps the input dim"). Exported models compute
those inputs in the graph (PyTorch's `x.reshape(b, -1)`, `k = n // 4`,
`F.interpolate(size=other.shape[-2:])`; the dynamo exporter does the shape arithmetic on int64
tensors), and ONNX's backend tests pass them as graph inputs.

Each converter first traces the shape-giving input back to the model's symbolic dims
(`shape_values`). Where every element is known, the op gets a `ShapeExpr` and its output keeps
symbolic dims, so later passes can fuse and plan it. Where some are only known when the model
runs, ONNX's rules (0 copies a dim, -1 is inferred, 1 broadcasts) are applied in the tensor
domain, and the result is `match_cast` to a shape whose known dims are kept and whose other dims
are fresh symbols, checked at run time. Each class subclasses TVM's converter and hands the
cases TVM gets right back to it.
"""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax, te, tirx, topi
from tvm.relax.frontend.onnx import onnx_frontend
from tvm.relax.frontend.onnx.onnx_frontend import get_constant

from ..schedules.fallback_cpu import MATERIALIZED
from .ops_gather import take_in_range
from .shape_values import constant_value, known_ints, same_dims_as, shape_values

# Slice bounds past this are "to the end": symbolic shape arithmetic on INT64_MAX overflows.
_SLICE_BOUND = 2**31 - 1
_ANALYZER = tvm.sym.Analyzer()


def is_runtime_tensor(value) -> bool:
    """A tensor whose values are known only when the model runs (not a constant, not a shape)."""
    return (isinstance(value, relax.Expr) and isinstance(value.ty, relax.TensorType)
            and not isinstance(value, tvm.ir.GenericConst))


def is_shape_value(value) -> bool:
    """A shape (or a scalar of one) that TVM folded at import: a ShapeExpr or a TIR expression."""
    return (isinstance(value, relax.ShapeExpr)
            or (isinstance(value, relax.Expr) and isinstance(value.ty, relax.ShapeType))
            or (tvm.ir.is_prim_expr(value) and isinstance(value.ty, tvm.ir.PrimType)))


def int64_tensor(bb: relax.BlockBuilder, value) -> relax.Expr:
    """`value` (tensor, shape or scalar TIR expression) as an int64 tensor."""
    if isinstance(value, relax.Expr) and isinstance(value.ty, relax.ShapeType):
        return bb.emit(relax.op.shape_to_tensor(value))
    if tvm.ir.is_prim_expr(value) and isinstance(value.ty, tvm.ir.PrimType):
        as_int64 = value if str(value.ty.dtype) == "int64" else tirx.Cast("int64", value)
        return bb.emit(relax.op.reshape(relax.op.shape_to_tensor(relax.ShapeExpr([as_int64])), []))
    value = bb.normalize(value)
    return value if value.ty.dtype == "int64" else bb.emit(relax.op.astype(value, "int64"))


def runtime_shape(bb: relax.BlockBuilder, vector: relax.Expr) -> relax.Expr:
    """A 1-D integer tensor of static length as a shape value, for ops that take a shape."""
    return bb.emit(relax.op.tensor_to_shape(int64_tensor(bb, vector)))


def runtime_symbols(bb: relax.BlockBuilder, vector: relax.Expr, prefix: str) -> list[tirx.Var]:
    """Fresh symbols bound, when the model runs, to the values of a 1-D integer tensor of static
    length, for a kernel to use as dims, offsets or strides. Pass them to `emit_te` as
    an argument: a symbol only captured by the compute is not passed to the kernel."""
    symbols = [tirx.Var(f"{prefix}{index}", "int64") for index in range(int(vector.ty.shape.values[0]))]
    bb.match_cast(runtime_shape(bb, vector), relax.ShapeType(symbols))
    return symbols


def with_dims(bb: relax.BlockBuilder, tensor: relax.Expr, dims: list, prefix: str) -> relax.Expr:
    """`tensor`, its type stating `dims`: the known ones as given, a fresh symbol for each None.

    The dims are bound by a match_cast of the tensor itself, checked when the model runs, and
    consumers use the cast tensor: a match_cast of a shape nobody uses is dropped by later passes,
    leaving its symbols undefined.
    """
    tensor = bb.normalize(tensor)
    if not any(dim is None for dim in dims) and isinstance(tensor.ty.shape, relax.ShapeExpr) and all(
            _ANALYZER.can_prove_equal(a, b) for a, b in zip(tensor.ty.shape.values, dims)):
        return tensor
    symbols = [tirx.Var(f"{prefix}{axis}", "int64") if dim is None else dim
               for axis, dim in enumerate(dims)]
    return bb.match_cast(tensor, relax.TensorType(symbols, tensor.ty.dtype))


def named_dims(bb: relax.BlockBuilder, tensor: relax.Expr, prefix: str) -> relax.Expr:
    """`tensor` with a fresh symbol for each dim its type does not know."""
    tensor = bb.normalize(tensor)
    if tensor.ty.shape is not None:
        return tensor
    return with_dims(bb, tensor, [None] * tensor.ty.ndim, prefix)


def runtime_arange(bb: relax.BlockBuilder, length: relax.Expr, prefix: str) -> relax.Expr:
    """0, 1, ..., n-1 for an n held in a one-element int64 tensor: indices of run-time length.

    Built as cumsum(ones(n)) - 1 so that the length travels as a shape value; TVM 0.27 lowers a
    dynamic_strided_slice to a call of a function it then loses, so slicing is done with `take`.
    """
    ones = bb.emit(relax.op.ones(runtime_shape(bb, relax.op.reshape(length, [1])), "int64"))
    counted = relax.op.subtract(relax.op.cumsum(ones, axis=0), relax.const(1, "int64"))
    return named_dims(bb, bb.emit(counted), prefix)


def _input_dims(data: relax.Expr) -> list | None:
    shape = data.ty.shape if isinstance(data.ty, relax.TensorType) else None
    return list(shape.values) if isinstance(shape, relax.ShapeExpr) else None


def _shape_tensor(bb: relax.BlockBuilder, data: relax.Expr) -> relax.Expr:
    return bb.emit(relax.op.shape_to_tensor(relax.op.shape_of(data)))


def _int64(value) -> relax.Expr:
    return relax.const(value, "int64")


def _optional_input(inputs, index: int, params):
    return get_constant(inputs[index], params) if len(inputs) > index and inputs[index] is not None else None


class Reshape(onnx_frontend.Reshape):
    """Reshape to a shape computed in the graph or given at run time.

    ONNX's 0 (copy the input dim, unless allowzero) and -1 (infer) are resolved symbolically when
    the target is traced, in the tensor domain otherwise. TVM passes a folded ShapeExpr to Relax
    as is, where a 0 means an empty dim.
    """

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        data, target = inputs[0], get_constant(inputs[1], params)
        if is_shape_value(data):
            target_values = shape_values(bb, target)
            if target_values is not None and len(target_values) == 1:
                # A shape (or a scalar of one) flattened stays a shape: [n] for the dynamo
                # exporter's `Reshape(n, [-1])` before a Concat of shape pieces.
                return relax.ShapeExpr(shape_values(bb, data))
            data = int64_tensor(bb, data)
        input_dims = _input_dims(data)
        if isinstance(target, tvm.ir.GenericConst) or input_dims is None:
            return super()._impl_v13(bb, inputs, attr, params)
        values = shape_values(bb, target)
        if values is None:
            return super()._impl_v13(bb, inputs, attr, params)
        dims = _reshape_dims(input_dims, values, bool(attr.get("allowzero", 0)))
        if known_ints(dims):
            reshaped = relax.op.reshape(_with_element_count(bb, data, dims), relax.ShapeExpr(dims))
            return with_dims(bb, reshaped, same_dims_as(dims, input_dims), "reshape_dim")
        return with_dims(bb, relax.op.reshape(data, runtime_shape(bb, _resolve_reshape_target(
            bb, data, int64_tensor(bb, target), len(values), bool(attr.get("allowzero", 0))))),
            dims, "reshape_dim")


def _with_element_count(bb, data, dims: list) -> relax.Expr:
    """`data`, flattened and checked at run time to hold prod(dims) elements where import time
    cannot prove it: Relax reshapes symbolic shapes without comparing element counts, and a
    wrong target (which onnxruntime rejects) would read past the data."""
    one = tirx.IntImm("int64", 1)
    count, wanted = math.prod(_input_dims(data), start=one), math.prod(dims, start=one)
    if _ANALYZER.can_prove_equal(count, wanted):
        return data
    flat = bb.emit(relax.op.reshape(data, relax.ShapeExpr([count])))
    return bb.match_cast(flat, relax.TensorType([_ANALYZER.simplify(wanted)], data.ty.dtype))


def _reshape_dims(input_dims: list, values: list, allowzero: bool) -> list:
    """The output dims ONNX Reshape gives for the traced target `values` (None where unknown)."""
    dims = []
    inferred_axis = None
    for axis, value in enumerate(values):
        if constant_value(value) == 0 and not allowzero:
            dims.append(input_dims[axis] if axis < len(input_dims) else None)
        elif constant_value(value) == -1:
            inferred_axis = axis
            dims.append(None)
        else:
            dims.append(value)
    if inferred_axis is not None:
        others = [dim for axis, dim in enumerate(dims) if axis != inferred_axis]
        if all(dim is not None for dim in others):
            one = tirx.IntImm("int64", 1)
            dims[inferred_axis] = _ANALYZER.simplify(
                tirx.floordiv(math.prod(input_dims, start=one), math.prod(others, start=one)))
    return dims


def _resolve_reshape_target(bb, data, target, length: int, allowzero: bool) -> relax.Expr:
    """The target shape tensor with 0 and -1 replaced by the dims they stand for."""
    input_shape = _shape_tensor(bb, data)
    if not allowzero:
        rank = len(data.ty.shape.values)
        copied = relax.op.strided_slice(input_shape, axes=[0], begin=[0], end=[min(length, rank)])
        if length > rank:  # a 0 past the input's rank is invalid ONNX; keep the shapes aligned
            copied = relax.op.concat([copied, _int64([0] * (length - rank))])
        target = bb.emit(relax.op.where(relax.op.equal(target, _int64(0)), copied, target))
    is_inferred = relax.op.equal(target, _int64(-1))
    known = relax.op.prod(relax.op.where(is_inferred, _int64(1), target))
    inferred = relax.op.floor_divide(relax.op.prod(input_shape), known)
    return bb.emit(relax.op.where(is_inferred, inferred, target))


class Expand(onnx_frontend.Expand):
    """Expand to a shape computed in the graph or given at run time, by ONNX's bidirectional
    broadcast: a target 1 keeps the input's dim (TVM 0.27 gives the target's 1 instead)."""

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        data, target = inputs[0], get_constant(inputs[1], params)
        input_dims = _input_dims(data)
        if isinstance(target, tvm.ir.GenericConst) or input_dims is None:
            return super()._impl_v13(bb, inputs, attr, params)
        values = shape_values(bb, target)
        if values is None:
            return super()._impl_v13(bb, inputs, attr, params)
        rank = max(len(input_dims), len(values))
        one = tirx.IntImm("int64", 1)
        aligned_input = [one] * (rank - len(input_dims)) + input_dims
        aligned_target = [one] * (rank - len(values)) + values
        dims = [_broadcast_dim(d, t) for d, t in zip(aligned_input, aligned_target)]
        if not known_ints(dims):
            # Run-time target: where it says 1, the input's dim (both right-aligned to `rank`).
            target = int64_tensor(bb, target)
            if len(values) < rank:
                target = relax.op.concat([_int64([1] * (rank - len(values))), target])
            input_shape = _shape_tensor(bb, data)
            if len(input_dims) < rank:
                input_shape = relax.op.concat([_int64([1] * (rank - len(input_dims))), input_shape])
            target = bb.emit(target)
            resolved = relax.op.where(relax.op.equal(target, _int64(1)), input_shape, target)
            dims = [tirx.Var(f"expand_dim{axis}", "int64") if dim is None else dim
                    for axis, dim in enumerate(dims)]
            bb.match_cast(runtime_shape(bb, bb.emit(resolved)), relax.ShapeType(dims))
        return relax.op.broadcast_to(_spread_symbolic_units(bb, data, dims), relax.ShapeExpr(dims))


def _spread_symbolic_units(bb, data, output_dims: list) -> relax.Expr:
    """`data` with each symbolic dim that may be 1 where the output's is not made the output's.

    A broadcast kernel treats a symbolic dim as equal to the output dim, so an input dim that is
    1 only at run time would be read out of bounds. Taking indices arange(out) mod dim along that
    axis repeats a unit dim and leaves an equal one as it is. (The dim is read from the tensor's
    shape: with the symbol passed as a scalar argument, FuseTIR fails on the fused kernel.)
    """
    input_dims = _input_dims(data)
    offset = len(output_dims) - len(input_dims)
    for axis, dim in enumerate(input_dims):
        output_dim = output_dims[axis + offset]
        if isinstance(dim, tirx.IntImm) or _ANALYZER.can_prove_equal(dim, output_dim):
            continue
        positions = relax.op.arange(tirx.IntImm("int64", 0), output_dim, tirx.IntImm("int64", 1), "int64")
        length = take_in_range(_shape_tensor(bb, data), _int64(axis), 0)
        indices = bb.emit(relax.op.floor_mod(positions, length))
        data = bb.emit(take_in_range(data, indices, axis))
    return data


def _broadcast_dim(input_dim, target_dim):
    """The output dim of ONNX's broadcast of an input dim with a target dim (None if unknown)."""
    input_value = constant_value(input_dim)
    if target_dim is None:  # an input dim other than 1 is kept whatever the target says
        return input_dim if input_value is not None and input_value != 1 else None
    target_value = constant_value(target_dim)
    if target_value == 1:
        return input_dim
    if input_value == 1:
        return target_dim
    if input_value is not None and target_value is not None:
        if input_value != target_value:
            raise ValueError(f"Expand cannot broadcast a dim of {input_value} to {target_value}")
        return input_dim
    if input_value is not None:  # a valid target is 1 or the input dim
        return input_dim
    if target_value is not None:
        return target_dim
    if _ANALYZER.can_prove_equal(input_dim, target_dim):
        return input_dim
    return tirx.max(input_dim, target_dim)


class Tile(onnx_frontend.Tile):
    """Tile with repeats computed in the graph: a broadcast over a new axis before each axis,
    then a reshape, so that traced repeats give symbolic output dims."""

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        data, repeats = inputs[0], get_constant(inputs[1], params)
        input_dims = _input_dims(data)
        values = None if isinstance(repeats, tvm.ir.GenericConst) else shape_values(bb, repeats)
        if input_dims is not None and known_ints(values) and len(values) == len(input_dims):
            interleaved = [dim for pair in zip([tirx.IntImm("int64", 1)] * len(input_dims), input_dims)
                           for dim in pair]
            broadcast = [dim for pair in zip(values, input_dims) for dim in pair]
            spread = relax.op.broadcast_to(relax.op.reshape(data, relax.ShapeExpr(interleaved)),
                                           relax.ShapeExpr(broadcast))
            return relax.op.reshape(spread, relax.ShapeExpr(
                [_ANALYZER.simplify(r * d) for r, d in zip(values, input_dims)]))
        if is_shape_value(repeats):
            inputs = [data, int64_tensor(bb, repeats)]
        return super()._impl_v13(bb, inputs, attr, params)


class ConstantOfShape(onnx_frontend.ConstantOfShape):
    """ConstantOfShape of a shape computed in the graph keeps its symbolic dims."""

    @classmethod
    def _impl_v9(cls, bb, inputs, attr, params):
        shape = get_constant(inputs[0], params)
        if isinstance(shape, tvm.ir.GenericConst):
            return super()._impl_v9(bb, inputs, attr, params)
        values = shape_values(bb, shape)
        if known_ints(values):
            return super()._impl_v9(bb, [relax.ShapeExpr(values)], attr, params)
        filled = super()._impl_v9(bb, [int64_tensor(bb, shape)], attr, params)
        return named_dims(bb, filled, "constant_dim") if values is None else with_dims(
            bb, filled, values, "constant_dim")


class Range(onnx_frontend.Range):
    """Range whose start, limit and delta are integers traced to shapes has a symbolic length,
    ceil((limit - start) / delta), instead of an unknown one; traced to constants (an inlined
    RMSNormalization's axes, Range(axis, Size(Shape(x)))), it is a constant."""

    @classmethod
    def _impl_v12(cls, bb, inputs, attr, params):
        traced = [shape_values(bb, get_constant(value, params)) for value in inputs]
        if all(known_ints(values) and len(values) == 1 for values in traced):
            start, limit, delta = (values[0] for values in traced)
            dtype = _scalar_dtype(inputs[0])
            constants = [constant_value(v) for v in (start, limit, delta)]
            if all(c is not None for c in constants):
                return relax.const(np.arange(*constants).astype(dtype))
            arange = relax.op.arange(start, limit, delta, "int64")
            return arange if dtype == "int64" else relax.op.astype(arange, dtype)
        return named_dims(bb, super()._impl_v12(bb, inputs, attr, params), "range_dim")


def _scalar_dtype(value) -> str:
    return str(value.ty.dtype)


class Slice(onnx_frontend.Slice):
    """Slice with starts, ends, axes or steps computed in the graph or given at run time.

    Traced to constants or shape expressions, they go to `strided_slice` (huge ends clamped:
    symbolic arithmetic on INT64_MAX overflows). Otherwise ONNX's clamping is done in the tensor
    domain for every dim at once (dims not sliced take their whole range), the clamped starts,
    steps and output lengths are bound to symbols, and one kernel gathers
    data[start + step * index] (TVM's own path lowers to dynamic_strided_slice, whose shape
    function the constant folding before legalization loses). A `take` of an arange per dim,
    as this was before, compiled 3 kernels a dim: 2 s for a rank-3 slice, 0.7 s now.
    """

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        data = inputs[0]
        parameters = [_optional_input(inputs, i, params) for i in (1, 2, 3, 4)]
        if (not any(is_runtime_tensor(value) for value in parameters)
                or isinstance(data, relax.ShapeExpr) or _input_dims(data) is None):
            return super()._impl_v13(bb, inputs, attr, params)
        starts, ends, axes, steps = [None if value is None else shape_values(bb, value)
                                     for value in parameters]
        rank = len(_input_dims(data))
        if axes is None and starts is not None:
            axes = [tirx.IntImm("int64", axis) for axis in range(len(starts))]
        if steps is None and starts is not None:
            steps = [tirx.IntImm("int64", 1)] * len(starts)
        if (all(known_ints(v) for v in (starts, ends, axes, steps))
                and all(constant_value(v) is not None for v in axes + steps)):
            return relax.op.strided_slice(
                data, [constant_value(axis) % rank for axis in axes],
                [_clamped(v) for v in starts], [_clamped(v) for v in ends],
                [constant_value(step) for step in steps], assume_inbound=False)
        return _slice_by_gather(bb, data, *parameters)


def _clamped(bound):
    value = constant_value(bound)
    if value is None:
        return bound
    return tirx.IntImm("int64", max(-_SLICE_BOUND, min(_SLICE_BOUND, value)))


def _slice_by_gather(bb, data, starts, ends, axes, steps) -> relax.Expr:
    rank = len(_input_dims(data))
    shape = _shape_tensor(bb, data)
    if axes is None:
        axes = _int64(list(range(int(starts.ty.shape.values[0]))))
    axes = int64_tensor(bb, axes)
    axes = bb.emit(relax.op.where(relax.op.less(axes, _int64(0)), relax.op.add(axes, _int64(rank)), axes))

    def full(defaults, values):  # per-dim vector: the given values at `axes`, defaults elsewhere
        if values is None:
            return defaults
        return bb.emit(relax.op.scatter_elements(defaults, axes, int64_tensor(bb, values)))

    # ONNX's clamping, for every dim at once (dims not sliced take their whole range)
    start, end, step = full(_int64([0] * rank), starts), full(shape, ends), full(_int64([1] * rank), steps)
    positive = relax.op.greater(step, _int64(0))
    last = relax.op.subtract(shape, _int64(1))
    start = relax.op.where(relax.op.less(start, _int64(0)), relax.op.add(start, shape), start)
    end = relax.op.where(relax.op.less(end, _int64(0)), relax.op.add(end, shape), end)
    start = bb.emit(relax.op.minimum(relax.op.maximum(start, _int64(0)), relax.op.where(positive, shape, last)))
    end = relax.op.minimum(relax.op.maximum(end, relax.op.where(positive, _int64(0), _int64(-1))),
                           relax.op.where(positive, shape, last))
    toward = relax.op.subtract(step, relax.op.where(positive, _int64(1), _int64(-1)))
    length = relax.op.maximum(
        relax.op.floor_divide(relax.op.add(relax.op.subtract(end, start), toward), step), _int64(0))

    out_dims, first, stride = (runtime_symbols(bb, bb.emit(vector), prefix) for vector, prefix
                               in [(length, "slice_dim"), (start, "slice_start"), (step, "slice_step")])
    return bb.emit_te(_strided_gather, data, out_dims, first, stride, primfunc_name_hint="slice")


def _strided_gather(data: te.Tensor, out_dims: list, first: list, stride: list) -> te.Tensor:
    """out[o] = data[first + o * stride], dim by dim."""
    return te.compute(out_dims, lambda *out: data(*[begin + index * step for begin, index, step
                                                    in zip(first, out, stride)]), name="slice")


class TopK(onnx_frontend.TopK):
    """TopK with k computed in the graph or given at run time: a full sort along the axis, then
    the first k (a slice when k is traced to the shapes, a take otherwise).

    Sorting is O(n log n) where a heap would do, which only matters for long axes with small k.
    `sorted=0` leaves the order to the implementation; sorted order is one.
    """

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        data, k = inputs[0], get_constant(inputs[1], params)
        traced = None if isinstance(k, tvm.ir.GenericConst) else shape_values(bb, k)
        if traced is not None and known_ints(traced) and constant_value(traced[0]) is not None:
            k = _int64([constant_value(traced[0])])
        if isinstance(k, tvm.ir.GenericConst):
            return super()._impl_v11(bb, [data, k], {**attr, "sorted": 1}, params)
        axis = attr.get("axis", -1)
        order = bb.emit(relax.op.argsort(data, axis=axis, descending=bool(attr.get("largest", 1)),
                                         dtype="int64"))
        if known_ints(traced):
            indices = bb.emit(relax.op.strided_slice(order, axes=[axis], begin=[0], end=[traced[0]]))
        else:
            first_k = runtime_arange(bb, relax.op.reshape(int64_tensor(bb, k), [1]), "topk_k")
            indices = bb.emit(take_in_range(order, first_k, axis))
        values = bb.emit(relax.op.gather_elements(data, indices, axis=axis))
        return relax.Tuple([values, indices])


class Resize(onnx_frontend.Resize):
    """ONNX Resize in every opset form: scales, sizes and roi constant, computed in the graph or
    given at run time; `axes` and `keep_aspect_ratio_policy` (opset 18); 1-D to 3-D spatial,
    channels first.

    onnxruntime maps output to input coordinates with the scale itself (x_in = (x_out + 0.5) /
    scale - 0.5 for half_pixel; align_corners and tf_crop_and_resize use the integer output
    length), while TVM's resize derives the scale from the integer output size: they differ
    whenever input * scale is not whole (shrinking 5 by 0.5). So a resize by scales passes TOPI's
    compute the fractional target length input * scale, as an expression or read from a tensor
    computed at run time, and the floored output shape apart. Antialiasing and
    half_pixel_symmetric are refused: TOPI has neither.
    """

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        # Resize-10 is (X, scales) with Upsample's asymmetric mapping; onnxruntime's nearest rounds
        # down when enlarging and up when shrinking at this opset.
        scales = get_constant(inputs[1], params)
        mode = attr.get("mode", b"nearest")
        rounding = b"floor"
        if mode == b"nearest":
            factors = [_constant_float(v) for v in shape_values(bb, scales) or [None]]
            if None in factors:
                raise ValueError("Resize-10 in nearest mode needs constant scales")
            if all(factor <= 1 for factor in factors) and any(factor < 1 for factor in factors):
                rounding = b"ceil"
            elif not all(factor >= 1 for factor in factors):
                raise ValueError("Resize-10 nearest that enlarges some dims and shrinks others is "
                                 "not supported")
        resize_attr = {"mode": mode, "coordinate_transformation_mode": b"asymmetric",
                       "nearest_mode": rounding}
        return cls._impl_v11(bb, [inputs[0], None, scales, None], resize_attr, params)

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        data = inputs[0]
        roi, scales, sizes = (_given_input(inputs, index, params) for index in (1, 2, 3))
        input_dims = _input_dims(data)
        if input_dims is None or not 3 <= len(input_dims) <= 5:
            raise ValueError("Resize needs a 3-D to 5-D (channels first) input of known rank")
        if attr.get("antialias", 0):
            raise ValueError("Resize with antialias=1 is not supported")
        coordinate_mode = attr.get("coordinate_transformation_mode", b"half_pixel").decode("ascii")
        if coordinate_mode == "half_pixel_symmetric":
            raise ValueError("Resize with coordinate_transformation_mode half_pixel_symmetric is "
                             "not supported")
        rank = len(input_dims)
        axes = [axis % rank for axis in attr.get("axes", range(rank))]
        policy = attr.get("keep_aspect_ratio_policy", b"stretch").decode("ascii")
        if sizes is not None:
            output_dims, targets = _resize_to_sizes(bb, input_dims, axes, sizes, policy)
        elif scales is not None:
            output_dims, targets = _resize_by_scales(bb, input_dims, axes, scales)
        else:
            raise ValueError("Resize needs scales or sizes")
        runtime_targets = None
        if any(dim is None for dim in output_dims):
            output_dims, runtime_targets = _runtime_output(bb, data, axes, scales, sizes, policy, output_dims)
            if runtime_targets is None:  # sizes: the target lengths are the output dims
                targets = [dim if target is None else target for dim, target in zip(output_dims, targets)]
        for axis in (0, 1):
            if not _ANALYZER.can_prove_equal(output_dims[axis], input_dims[axis]):
                raise ValueError("Resize of the batch or channel dim is not supported")
        roi = _spatial_roi(bb, roi, axes, rank) if coordinate_mode == "tf_crop_and_resize" else None
        return _emit_resize(bb, data, output_dims, targets, runtime_targets, roi, attr)

    @classmethod
    def _impl_v18(cls, bb, inputs, attr, params):
        # Overrides TVM's converter, which the highest-version lookup would pick from opset 18 on.
        return cls._impl_v11(bb, inputs, attr, params)


def _given_input(inputs, index: int, params):
    """An optional input, None when absent or an empty tensor (exporters write both)."""
    value = _optional_input(inputs, index, params)
    if isinstance(value, tvm.ir.GenericConst) and value.value.numpy().size == 0:
        return None
    return value


def _constant_float(element) -> float | None:
    if isinstance(element, (tirx.FloatImm, tirx.IntImm)):
        return float(element.value)
    return None


def _resize_to_sizes(bb, input_dims: list, axes: list, sizes, policy: str):
    """Output dims and target lengths for Resize given sizes (None where known only at run time)."""
    values = shape_values(bb, sizes)
    if values is None or len(values) != len(axes):
        raise ValueError("Resize sizes must be a vector with one element per resized axis")
    output_dims = list(input_dims)
    if policy == "stretch":
        for axis, value in zip(axes, values):
            output_dims[axis] = value
        return output_dims, list(output_dims)
    # ONNX: one scale for all axes, the smallest (not_larger) or largest (not_smaller) ratio;
    # each output dim is input * scale rounded half up, coordinates mapped with that scale.
    wanted = [constant_value(value) for value in values]
    given = [constant_value(input_dims[axis]) for axis in axes]
    if None in wanted + given:
        return [None if axis in axes else dim for axis, dim in enumerate(input_dims)], [None] * len(input_dims)
    ratios = [np.float32(w) / np.float32(g) for w, g in zip(wanted, given)]
    scale = min(ratios) if policy == "not_larger" else max(ratios)
    targets = list(input_dims)
    for axis, dim in zip(axes, given):
        targets[axis] = tirx.FloatImm("float32", float(scale * np.float32(dim)))
        output_dims[axis] = tirx.IntImm("int64", int(scale * np.float32(dim) + np.float32(0.5)))
    return output_dims, targets


def _resize_by_scales(bb, input_dims: list, axes: list, scales):
    """Output dims (floor(input * scale)) and target lengths (input * scale) for Resize given
    scales, None where a scale is known only at run time."""
    values = shape_values(bb, scales)
    if values is None or len(values) != len(axes):
        raise ValueError("Resize scales must be a vector with one element per resized axis")
    output_dims, targets = list(input_dims), list(input_dims)
    for axis, scale in zip(axes, values):
        dim = input_dims[axis]
        factor = _constant_float(scale)
        if factor == 1.0:
            continue
        if factor is not None and factor.is_integer():
            output_dims[axis] = _ANALYZER.simplify(dim * int(factor))
            # A symbolic whole target (h * 2) makes TVM 0.27's TIR lowering of a linear resize
            # fail ("IntImm supports only int"); the same value as a float expression does not.
            targets[axis] = output_dims[axis] if constant_value(dim) is not None else (
                tirx.Cast("float32", dim) * tirx.FloatImm("float32", factor))
        elif factor is not None and constant_value(dim) is not None:
            product = np.float32(constant_value(dim)) * np.float32(factor)
            output_dims[axis] = tirx.IntImm("int64", int(np.floor(product)))
            targets[axis] = tirx.FloatImm("float32", float(product))
        elif scale is not None:
            product = tirx.Cast("float32", dim) * tirx.Cast("float32", scale)
            output_dims[axis] = _ANALYZER.simplify(tirx.Cast("int64", tirx.floor(product)))
            targets[axis] = product
        else:
            output_dims[axis] = targets[axis] = None
    return output_dims, targets


def _runtime_output(bb, data, axes: list, scales, sizes, policy: str, output_dims: list):
    """Output dims with each unknown one a fresh symbol, bound by a match_cast of the output
    shape computed at run time (and checked there), and the target lengths as a float tensor
    over all dims (None when they are the output dims, as for sizes)."""
    input_shape = _shape_tensor(bb, data)
    input_lengths = relax.op.astype(input_shape, "float32")
    axes_tensor = _int64(axes)
    targets = None
    if sizes is not None and policy == "stretch":
        shape = relax.op.scatter_elements(input_shape, axes_tensor, int64_tensor(bb, sizes))
    elif sizes is not None:
        resized_lengths = take_in_range(input_lengths, axes_tensor, 0)
        ratios = relax.op.divide(relax.op.astype(int64_tensor(bb, sizes), "float32"), resized_lengths)
        scale = relax.op.min(ratios) if policy == "not_larger" else relax.op.max(ratios)
        scaled = bb.emit(relax.op.multiply(resized_lengths, scale))
        targets = bb.emit(relax.op.scatter_elements(input_lengths, axes_tensor, scaled))
        rounded = relax.op.astype(relax.op.floor(relax.op.add(scaled, relax.const(0.5, "float32"))), "int64")
        shape = relax.op.scatter_elements(input_shape, axes_tensor, rounded)
    else:
        full_scales = relax.op.scatter_elements(relax.const(np.ones(len(output_dims), "float32")),
                                                axes_tensor, relax.op.astype(scales, "float32"))
        targets = bb.emit(relax.op.multiply(input_lengths, full_scales))
        shape = relax.op.astype(relax.op.floor(targets), "int64")
    # Batch and channel are never resized; the match_cast checks that the run-time values agree.
    input_dims = _input_dims(data)
    dims = [input_dims[axis] if axis < 2 and dim is None else dim for axis, dim in enumerate(output_dims)]
    dims = [tirx.Var(f"resize_dim{axis}", "int64") if dim is None else dim for axis, dim in enumerate(dims)]
    bb.match_cast(runtime_shape(bb, bb.emit(shape)), relax.ShapeType(dims))
    return dims, targets


def _spatial_roi(bb, roi, axes: list, rank: int):
    """TOPI's roi (spatial starts, then spatial ends) from ONNX's (starts, ends over `axes`): a
    list of floats, or a float tensor when the roi is given at run time."""
    starts, ends = [0.0] * rank, [1.0] * rank
    if roi is None:
        return starts[2:] + ends[2:]
    if isinstance(roi, tvm.ir.GenericConst):
        values = roi.value.numpy().astype("float64").tolist()
        for index, axis in enumerate(axes):
            starts[axis], ends[axis] = values[index], values[len(axes) + index]
        return starts[2:] + ends[2:]
    roi = relax.op.astype(roi, "float32")
    count = len(axes)
    axes_tensor = _int64(axes)
    full_starts = relax.op.scatter_elements(relax.const(np.array(starts, "float32")), axes_tensor,
                                            relax.op.strided_slice(roi, axes=[0], begin=[0], end=[count]))
    full_ends = relax.op.scatter_elements(relax.const(np.array(ends, "float32")), axes_tensor,
                                          relax.op.strided_slice(roi, axes=[0], begin=[count], end=[2 * count]))
    spatial = [relax.op.strided_slice(full, axes=[0], begin=[2], end=[rank]) for full in (full_starts, full_ends)]
    return bb.emit(relax.op.concat(spatial, axis=0))


def _emit_resize(bb, data, output_dims: list, targets: list, runtime_targets, roi, attr) -> relax.Expr:
    """The resize: Relax's resize2d/3d op where the target lengths are the integer output dims
    and the roi constant; otherwise TOPI's compute, given the target lengths (expressions, or
    elements of `runtime_targets` where None) and the output shape apart (1-D always: Relax has
    no resize1d op)."""
    spatial_rank = len(output_dims) - 2
    mode = attr.get("mode", b"nearest").decode("ascii")
    method = "nearest_neighbor" if mode == "nearest" else mode
    coordinate_mode = attr.get("coordinate_transformation_mode", b"half_pixel").decode("ascii")
    rounding = attr.get("nearest_mode", b"round_prefer_floor").decode("ascii")
    alpha, exclude = attr.get("cubic_coeff_a", -0.75), attr.get("exclude_outside", 0)
    extrapolation = attr.get("extrapolation_value", 0.0)
    layout = ["NCW", "NCHW", "NCDHW"][spatial_rank - 1]
    if roi is None:
        roi = [0.0] * (2 * spatial_rank)
    if coordinate_mode in ("align_corners", "tf_crop_and_resize"):
        # These map with (in - 1) / (out - 1) of the integer output length in onnxruntime (onnx's
        # reference uses input * scale); a symbolic length goes in as float, see _resize_by_scales.
        targets = [dim if constant_value(dim) is not None else tirx.Cast("float32", dim)
                   for dim in output_dims]
        runtime_targets = None
    whole_targets = all(target is not None and str(target.ty.dtype).startswith("int") for target in targets)
    spatial_lengths = data.ty.shape.values[2:]
    if (method == "nearest_neighbor" and coordinate_mode in _NEAREST_COORDINATES
            and all(target is not None for target in targets)
            and not all(_power_of_two_ratio(target, length)
                        for target, length in zip(targets[2:], spatial_lengths))):
        return bb.emit_te(_nearest_resize, data, output_dims, targets, coordinate_mode, rounding,
                          primfunc_name_hint="resize_nearest")
    if whole_targets and isinstance(roi, list) and spatial_rank in (2, 3):
        resize_op = relax.op.image.resize2d if spatial_rank == 2 else relax.op.image.resize3d
        return bb.emit(resize_op(
            data, size=relax.ShapeExpr(output_dims[2:]), roi=roi, layout=layout, method=method,
            coordinate_transformation_mode=coordinate_mode, rounding_method=rounding,
            cubic_alpha=alpha, cubic_exclude=exclude, extrapolation_value=extrapolation))
    topi_resize = {1: topi.image.resize1d, 2: topi.image.resize2d, 3: topi.image.resize3d}[spatial_rank]

    def resize(data_te, runtime_targets_te, roi_te):
        lengths = [runtime_targets_te[axis] if target is None else target
                   for axis, target in enumerate(targets)]
        spatial_roi = roi if roi_te is None else [roi_te[i] for i in range(2 * spatial_rank)]
        return topi_resize(data_te, spatial_roi, lengths[2:], layout, method, coordinate_mode, rounding,
                           alpha, exclude, extrapolation, output_shape=output_dims)

    return bb.emit_te(resize, data, runtime_targets, None if isinstance(roi, list) else roi)


# onnxruntime's source coordinate of output position x along a dim: scale = target / input
# length (the given scale, or the output size over the input's); `length` is the output's.
# align_corners and tf_crop_and_resize stay TOPI's (no multiply-add there).
_NEAREST_COORDINATES = {
    "half_pixel": lambda x, scale, length: (x + 0.5) / scale - 0.5,
    "pytorch_half_pixel": lambda x, scale, length: tirx.if_then_else(
        length > 1, (x + 0.5) / scale - 0.5, tirx.const(0.0, "float32")),
    "tf_half_pixel_for_nn": lambda x, scale, length: (x + 0.5) / scale,
    "asymmetric": lambda x, scale, length: x / scale,
}
_NEAREST_ROUNDING = {
    "round_prefer_floor": lambda v: tirx.if_then_else(v == tirx.floor(v) + 0.5, tirx.floor(v), tirx.round(v)),
    "round_prefer_ceil": lambda v: tirx.floor(v + 0.5),
    "floor": tirx.floor,
    "ceil": tirx.ceil,
}


def _power_of_two_ratio(target, length) -> bool:
    """Whether a resize from `length` to `target` scales by a power of two (1, 2, 4, ... or its
    inverse), provably at compile time. There TOPI's product by the inverse scale is exact, so
    its nearest resize agrees with onnxruntime's, and over a static map it was the faster one:
    detector_fpn compiled for 1x3x32x48 ran in 12.9 us with it, 15.2 us with `_nearest_resize`
    (whose index tables keep the static copy from being fused into one loop). Over a symbolic
    map `_nearest_resize` was faster: 18.3 against 20.1 us at 1x3x32x48, 51.3 against 58.5 us
    at 2x3x64x40."""
    for factor in (1, 2, 4, 8, 16, 32):
        if isinstance(target, tirx.FloatImm) and isinstance(length, tirx.IntImm):
            if target.value in (length.value * factor, length.value / factor):
                return True
        elif str(target.ty.dtype).startswith("int") and (
                _ANALYZER.can_prove_equal(target, length * factor)
                or _ANALYZER.can_prove_equal(target * factor, length)):
            return True
    return False


def _as_float(value) -> tirx.PrimExpr:
    return tirx.Cast("float32", value)


def _nearest_resize(data: te.Tensor, output_dims: list, targets: list, coordinate_mode: str,
                    rounding: str) -> te.Tensor:
    """Nearest resize with onnxruntime's arithmetic: the source coordinate divides by the scale.
    TOPI multiplies by its inverse, and LLVM fuses that product and the - 0.5 after it into one
    multiply-add, whose unrounded result moves a coordinate that is exactly a half (output row
    3 of 2 -> 7: 0.5) past it (0.50000004), so the rounding picked the next row. Each axis's
    source indices are a small table computed once (MATERIALIZED), which the copy reads."""
    rank = len(output_dims)

    def source_indices(axis):
        length_in = data.shape[axis]
        scale = _as_float(targets[axis]) / _as_float(length_in)

        def index(x):
            coordinate = _NEAREST_COORDINATES[coordinate_mode](
                _as_float(x), scale, output_dims[axis])
            rounded = tirx.Cast("int64", _NEAREST_ROUNDING[rounding](coordinate))
            return tirx.max(tirx.min(rounded, length_in - 1), tirx.const(0, "int64"))

        return te.compute((output_dims[axis],), index, name=f"resize_source_{axis}",
                          attrs={MATERIALIZED: 1})

    tables = [source_indices(axis) for axis in range(2, rank)]
    return te.compute(output_dims, lambda *out: data(*out[:2], *[
        table[out[axis]] for axis, table in zip(range(2, rank), tables)]), name="resize_nearest")


class Upsample(onnx_frontend.Upsample):
    """Upsample (opsets 7-9, Resize's predecessor) as a Resize with asymmetric coordinates and
    nearest rounding down. The scales are an attribute up to opset 8 and an input from opset 9
    (TVM 0.27 reads the attribute in both, and needs static dims)."""

    @classmethod
    def _impl_v7(cls, bb, inputs, attr, params):
        return cls._upsample(bb, inputs[0], relax.const(np.array(attr["scales"], "float32")), attr, params)

    @classmethod
    def _impl_v9(cls, bb, inputs, attr, params):
        return cls._upsample(bb, inputs[0], get_constant(inputs[1], params), attr, params)

    @classmethod
    def _upsample(cls, bb, data, scales, attr, params):
        mode = attr.get("mode", b"nearest").decode("ascii")
        if mode not in ("nearest", "linear"):
            raise ValueError(f"Upsample mode {mode!r} is not one of nearest, linear")
        resize_attr = {"mode": mode.encode(), "coordinate_transformation_mode": b"asymmetric",
                       "nearest_mode": b"floor"}
        return Resize._impl_v11(bb, [data, None, scales, None], resize_attr, params)


class Concat(onnx_frontend.Concat):
    """Concatenation of shape pieces stays a shape when every piece is one (possibly converted to
    a tensor on the way), so that the Reshape or Resize it feeds keeps symbolic dims."""

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        pieces = [shape_values(bb, value) for value in inputs]
        if all(known_ints(piece) for piece in pieces) and any(
                isinstance(value, relax.Expr) and not isinstance(value, tvm.ir.GenericConst)
                for value in inputs):
            return relax.ShapeExpr([value for piece in pieces for value in piece])
        if any(isinstance(value, relax.ShapeExpr) for value in inputs) and not all(
                isinstance(value, relax.ShapeExpr) for value in inputs):
            inputs = [bb.emit(relax.op.shape_to_tensor(value)) if isinstance(value, relax.ShapeExpr)
                      else value for value in inputs]
        joined = super()._impl_v13(bb, inputs, attr, params)
        if (isinstance(joined, relax.Call) and bb.normalize(joined).ty.shape is None
                and all(isinstance(value.ty.shape, relax.ShapeExpr) for value in inputs)):
            return relax.op.concat(_agreeing_off_axis(bb, inputs, attr.get("axis", 0)), attr.get("axis", 0))
        return joined


def _agreeing_off_axis(bb: relax.BlockBuilder, tensors: list, axis: int) -> list:
    """ONNX requires concatenated tensors to agree off the axis; where Relax cannot prove it
    (maps resized to computed sizes), state it with match_cast, checked at run time."""
    reference = tensors[0].ty.shape.values
    axis = axis % len(reference)
    agreeing = [tensors[0]]
    for tensor in tensors[1:]:
        dims = [dim if index == axis else reference[index]
                for index, dim in enumerate(tensor.ty.shape.values)]
        agreeing.append(bb.match_cast(tensor, relax.TensorType(dims, tensor.ty.dtype)))
    return agreeing


CONVERTERS = {
    "Reshape": Reshape, "Expand": Expand, "Tile": Tile, "ConstantOfShape": ConstantOfShape,
    "Range": Range, "Slice": Slice, "TopK": TopK, "Resize": Resize, "Upsample": Upsample,
    "Concat": Concat,
}
