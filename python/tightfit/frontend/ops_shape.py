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
from tvm import relax, tirx
from tvm.relax.frontend.onnx import onnx_frontend
from tvm.relax.frontend.onnx.onnx_frontend import get_constant

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
            reshaped = relax.op.reshape(data, relax.ShapeExpr(dims))
            return with_dims(bb, reshaped, same_dims_as(dims, input_dims), "reshape_dim")
        return with_dims(bb, relax.op.reshape(data, runtime_shape(bb, _resolve_reshape_target(
            bb, data, int64_tensor(bb, target), len(values), bool(attr.get("allowzero", 0))))),
            dims, "reshape_dim")


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
        if known_ints(dims):
            return relax.op.broadcast_to(data, relax.ShapeExpr(dims))
        # Run-time target: where it says 1, the input's dim (both right-aligned to `rank`).
        target = int64_tensor(bb, target)
        if len(values) < rank:
            target = relax.op.concat([_int64([1] * (rank - len(values))), target])
        input_shape = _shape_tensor(bb, data)
        if len(input_dims) < rank:
            input_shape = relax.op.concat([_int64([1] * (rank - len(input_dims))), input_shape])
        target = bb.emit(target)
        output_shape = relax.op.where(relax.op.equal(target, _int64(1)), input_shape, target)
        expanded = relax.op.broadcast_to(data, runtime_shape(bb, bb.emit(output_shape)))
        return with_dims(bb, expanded, dims, "expand_dim")


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
    ceil((limit - start) / delta), instead of an unknown one."""

    @classmethod
    def _impl_v12(cls, bb, inputs, attr, params):
        traced = [shape_values(bb, get_constant(value, params)) for value in inputs]
        if all(known_ints(values) and len(values) == 1 for values in traced):
            start, limit, delta = (values[0] for values in traced)
            if not all(constant_value(v) is not None for v in (start, limit, delta)):
                dtype = _scalar_dtype(inputs[0])
                arange = relax.op.arange(start, limit, delta, "int64")
                return arange if dtype == "int64" else relax.op.astype(arange, dtype)
        return named_dims(bb, super()._impl_v12(bb, inputs, attr, params), "range_dim")


def _scalar_dtype(value) -> str:
    return str(value.ty.dtype)


class Slice(onnx_frontend.Slice):
    """Slice with starts, ends, axes or steps computed in the graph or given at run time.

    Traced to constants or shape expressions, they go to `strided_slice` (huge ends clamped:
    symbolic arithmetic on INT64_MAX overflows). Otherwise every dim is a `take` of
    start + step * arange(count), ONNX's clamping done in the tensor domain (dims not sliced take
    their whole range): TVM's own path lowers to dynamic_strided_slice, whose shape function the
    constant folding before legalization loses.
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
        return _slice_by_take(bb, data, *parameters)


def _clamped(bound):
    value = constant_value(bound)
    if value is None:
        return bound
    return tirx.IntImm("int64", max(-_SLICE_BOUND, min(_SLICE_BOUND, value)))


def _slice_by_take(bb, data, starts, ends, axes, steps) -> relax.Expr:
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

    all_starts = full(_int64([0] * rank), starts)
    all_ends = full(shape, ends)
    all_steps = full(_int64([1] * rank), steps)
    result = data
    for axis in range(rank):
        def at(vector):
            return bb.emit(relax.op.take(vector, _int64(axis), axis=0))

        dim, start, end, step = at(shape), at(all_starts), at(all_ends), at(all_steps)
        positive = relax.op.greater(step, _int64(0))
        last = relax.op.subtract(dim, _int64(1))
        start = relax.op.where(relax.op.less(start, _int64(0)), relax.op.add(start, dim), start)
        end = relax.op.where(relax.op.less(end, _int64(0)), relax.op.add(end, dim), end)
        start = relax.op.minimum(relax.op.maximum(start, _int64(0)), relax.op.where(positive, dim, last))
        end = relax.op.minimum(relax.op.maximum(end, relax.op.where(positive, _int64(0), _int64(-1))),
                               relax.op.where(positive, dim, last))
        start, end = bb.emit(start), bb.emit(end)
        toward = relax.op.subtract(step, relax.op.where(positive, _int64(1), _int64(-1)))
        length = relax.op.maximum(
            relax.op.floor_divide(relax.op.add(relax.op.subtract(end, start), toward), step), _int64(0))
        offsets = runtime_arange(bb, bb.emit(length), f"slice_axis{axis}_")
        indices = bb.emit(relax.op.add(start, relax.op.multiply(step, offsets)))
        result = bb.emit(relax.op.take(result, indices, axis=axis))
    return result


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
            indices = bb.emit(relax.op.take(order, first_k, axis=axis))
        values = bb.emit(relax.op.gather_elements(data, indices, axis=axis))
        return relax.Tuple([values, indices])


class Resize(onnx_frontend.Resize):
    """Resize to sizes, or by scales, computed in the graph or given at run time (1-D to 3-D
    spatial, channels first; a 1-D resize is done as a 2-D one of height 1)."""

    @classmethod
    def _impl_v18(cls, bb, inputs, attr, params):
        data = inputs[0]
        roi, scales, sizes = (_optional_input(inputs, i, params) for i in (1, 2, 3))
        if not any(is_runtime_tensor(v) or is_shape_value(v) for v in (scales, sizes)):
            return super()._impl_v18(bb, inputs, attr, params)
        input_dims = _input_dims(data)
        if input_dims is None or not 3 <= len(input_dims) <= 5 or is_runtime_tensor(roi):
            raise ValueError("Resize to computed sizes or scales needs a 3-D to 5-D input of "
                             "known rank and a constant roi")
        spatial_rank = len(input_dims) - 2
        if sizes is not None:
            values = shape_values(bb, sizes)
            dims = values[2:] if known_ints(values) else None
            if dims is None:
                size_tensor = relax.op.strided_slice(int64_tensor(bb, sizes), axes=[0], begin=[2],
                                                     end=[len(input_dims)])
        else:
            values = shape_values(bb, scales)
            dims = None
            if values is not None and all(v is not None for v in values):
                dims = [_ANALYZER.simplify(tirx.Cast("int64", tirx.floor(
                    tirx.Cast("float32", dim) * tirx.Cast("float32", scale))))
                    for dim, scale in zip(input_dims[2:], values[2:])]
            else:
                input_shape = bb.emit(relax.op.astype(_shape_tensor(bb, data), "float32"))
                scaled = relax.op.floor(relax.op.multiply(input_shape, relax.op.astype(scales, "float32")))
                size_tensor = relax.op.strided_slice(relax.op.astype(scaled, "int64"), axes=[0],
                                                     begin=[2], end=[len(input_dims)])
        if spatial_rank == 1:  # resized as a 4-D map of height 1: Relax has no resize1d op
            data = relax.op.expand_dims(data, 2)
            roi = _roi_with_unit_height(roi)
            dims_2d = None if dims is None else [tirx.IntImm("int64", 1)] + dims
            if dims is None:
                size_tensor = relax.op.concat([_int64([1]), size_tensor])
            size = relax.ShapeExpr(dims_2d) if dims_2d is not None else runtime_shape(bb, bb.emit(size_tensor))
            resized = relax.op.squeeze(_resize(bb, bb.normalize(data), size, 2, roi, attr), [2])
        else:
            size = relax.ShapeExpr(dims) if dims is not None else runtime_shape(bb, bb.emit(size_tensor))
            resized = _resize(bb, data, size, spatial_rank, roi, attr)
        return with_dims(bb, resized, input_dims[:2] + (dims or [None] * spatial_rank), "resize_dim")


def _roi_with_unit_height(roi):
    """ONNX's roi of a 3-D (N, C, W) resize for the same resize done on (N, C, 1, W)."""
    if not isinstance(roi, tvm.ir.GenericConst) or roi.value.numpy().size != 6:
        return None
    starts, ends = roi.value.numpy().reshape(2, 3).tolist()
    return relax.const(np.array(starts[:2] + [0.0] + starts[2:] + ends[:2] + [1.0] + ends[2:], "float32"))


def _resize(bb, data, size, spatial_rank: int, roi, attr) -> relax.Expr:
    """Relax's resize2d/3d with ONNX Resize's attributes."""
    mode = attr.get("mode", b"nearest").decode("ascii")
    roi_values = roi.value.numpy().tolist() if isinstance(roi, tvm.ir.GenericConst) else []
    rank = spatial_rank + 2
    spatial_roi = (roi_values[2:rank] + roi_values[rank + 2:] if len(roi_values) == 2 * rank
                   else [0.0] * (2 * spatial_rank))
    options = dict(
        method="nearest_neighbor" if mode == "nearest" else mode,
        coordinate_transformation_mode=attr.get("coordinate_transformation_mode", b"half_pixel").decode("ascii"),
        rounding_method=attr.get("nearest_mode", b"round_prefer_floor").decode("ascii"),
        extrapolation_value=attr.get("extrapolation_value", 0.0),
        cubic_alpha=attr.get("cubic_coeff_a", -0.75),
        cubic_exclude=attr.get("exclude_outside", 0),
    )
    if spatial_rank == 2:
        return bb.emit(relax.op.image.resize2d(data, size=size, roi=spatial_roi, layout="NCHW", **options))
    # resize3d's roi is (start_d, start_h, start_w, end_d, end_h, end_w) like ONNX's spatial roi.
    return bb.emit(relax.op.image.resize3d(data, size=size, roi=spatial_roi, layout="NCDHW", **options))


class Upsample(onnx_frontend.Upsample):
    """Upsample (opsets 7-9; Resize's predecessor): each dim multiplied by its scale and floored,
    nearest neighbour by floor of out / scale, linear with asymmetric coordinates. The scales are
    an attribute up to opset 8 and an input from opset 9 (TVM 0.27 reads the attribute in both)."""

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
        if isinstance(scales, tvm.ir.GenericConst):
            input_dims = _input_dims(data)
            scale_values = scales.value.numpy().tolist()
            if input_dims is None or len(scale_values) != len(input_dims):
                raise ValueError("Upsample needs an input of known rank and one scale per dim")
            if scale_values[:2] != [1.0, 1.0]:
                raise ValueError("Upsample of the batch or channel dim is not supported")
            dims = [_ANALYZER.simplify(tirx.Cast("int64", tirx.floor(tirx.Cast("float32", dim) * scale)))
                    if not isinstance(dim, tirx.IntImm) else tirx.IntImm("int64", int(dim.value * scale))
                    for dim, scale in zip(input_dims[2:], scale_values[2:])]
            return with_dims(bb, _resize(bb, data, relax.ShapeExpr(dims), len(dims), None, resize_attr),
                             input_dims[:2] + dims, "upsample_dim")
        return Resize._impl_v18(bb, [data, None, scales, None], resize_attr, params)


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
