"""Converters for ops whose output shape comes from a tensor computed at run time.

TVM 0.27's importer requires the shape-giving input of these ops to be a constant or a
`ShapeExpr` it could fold at import time, and fails otherwise ("Reshape requires the input new
shape to be Shape", "TopK k must be a constant", `int(val.value)` on a symbolic Resize size).
Exported models compute such inputs in the graph (PyTorch's `x.reshape(batch, -1)`, `k = n // 4`,
`F.interpolate(size=other.shape[-2:])`), and the ONNX backend tests pass them as graph inputs.

The common tools: `runtime_shape` turns an int64 vector tensor into a shape value that Relax ops
taking a shape accept, and `named_dims` gives the result's unknown dims fresh symbols bound by a
`match_cast` (checked when the model runs), so that later ops can be lowered. Each class subclasses TVM's converter and hands the cases TVM handles back
to it, so only the run-time path is new. (SoD2 §3: these are the ISVDOS ops.)
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.relax.frontend.onnx import onnx_frontend
from tvm.relax.frontend.onnx.onnx_frontend import get_constant


def is_runtime_tensor(value) -> bool:
    """A tensor whose values are known only when the model runs (not a constant, not a shape)."""
    return (isinstance(value, relax.Expr) and isinstance(value.ty, relax.TensorType)
            and not isinstance(value, tvm.ir.GenericConst))


def runtime_shape(bb: relax.BlockBuilder, vector: relax.Expr) -> relax.Expr:
    """A 1-D integer tensor of static length as a shape value, for ops that take a shape."""
    vector = bb.normalize(vector)
    as_int64 = vector if vector.ty.dtype == "int64" else bb.emit(relax.op.astype(vector, "int64"))
    return bb.emit(relax.op.tensor_to_shape(as_int64))


def runtime_arange(bb: relax.BlockBuilder, length: relax.Expr, prefix: str) -> relax.Expr:
    """0, 1, ..., n-1 for an n held in a one-element int64 tensor: indices of run-time length.

    Built as cumsum(ones(n)) - 1 so that the length travels as a shape value; TVM 0.27 lowers a
    dynamic_strided_slice to a call of a function it then loses, so slicing is done with `take`.
    """
    ones = bb.emit(relax.op.ones(runtime_shape(bb, relax.op.reshape(length, [1])), "int64"))
    counted = relax.op.subtract(relax.op.cumsum(ones, axis=0), relax.const(1, "int64"))
    return named_dims(bb, bb.emit(counted), prefix)


def named_dims(bb: relax.BlockBuilder, tensor: relax.Expr, prefix: str) -> relax.Expr:
    """`tensor` with a fresh symbol for each dim its type does not know.

    The symbols are bound by a match_cast of the tensor itself (checked at run time), which its
    consumers use — a match_cast of a shape nobody uses is dropped by later passes, leaving the
    symbols undefined.
    """
    ty = tensor.ty
    if ty.shape is not None:
        return tensor
    symbols = [tirx.Var(f"{prefix}{axis}", "int64") for axis in range(ty.ndim)]
    return bb.match_cast(tensor, relax.TensorType(symbols, ty.dtype))


def _shape_tensor(bb: relax.BlockBuilder, data: relax.Expr) -> relax.Expr:
    return bb.emit(relax.op.shape_to_tensor(relax.op.shape_of(data)))


class Reshape(onnx_frontend.Reshape):
    """Reshape to a run-time shape, with ONNX's 0 (copy that dim) and -1 (infer) resolved in
    the tensor domain before the shape becomes symbolic."""

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        data, target = inputs[0], get_constant(inputs[1], params)
        if not is_runtime_tensor(target) or isinstance(data, relax.ShapeExpr):
            return super()._impl_v13(bb, inputs, attr, params)
        target = bb.emit(relax.op.astype(target, "int64"))
        length = int(target.ty.shape.values[0])
        input_shape = _shape_tensor(bb, data)
        if not attr.get("allowzero", 0):
            rank = len(data.ty.shape.values)
            copied = relax.op.strided_slice(input_shape, axes=[0], begin=[0], end=[min(length, rank)])
            if length > rank:  # a 0 past the input's rank is invalid ONNX; keep the shapes aligned
                copied = relax.op.concat([copied, relax.const([0] * (length - rank), "int64")])
            zero = relax.const(0, "int64")
            target = bb.emit(relax.op.where(relax.op.equal(target, zero), copied, target))
        minus_one = relax.const(-1, "int64")
        known = relax.op.prod(relax.op.where(relax.op.equal(target, minus_one),
                                             relax.const(1, "int64"), target))
        inferred = relax.op.floor_divide(relax.op.prod(input_shape), known)
        target = bb.emit(relax.op.where(relax.op.equal(target, minus_one), inferred, target))
        return named_dims(bb, bb.emit(relax.op.reshape(data, runtime_shape(bb, target))), "reshape_dim")


class TopK(onnx_frontend.TopK):
    """TopK with a k known only at run time: a full sort along the axis, then the first k.

    Sorting is O(n log n) where a heap would do, which only matters for long axes with small k.
    """

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        k = get_constant(inputs[1], params)
        if isinstance(k, relax.ShapeExpr) and isinstance(k.values[0], tirx.IntImm):
            k = relax.const([int(k.values[0])], "int64")
        if not (is_runtime_tensor(k) or isinstance(k, relax.ShapeExpr)):
            return super()._impl_v11(bb, inputs, attr, params)
        data = inputs[0]
        axis = attr.get("axis", -1)
        if not attr.get("sorted", 1):
            raise ValueError("TopK with sorted=0 is not supported")
        order = bb.emit(relax.op.argsort(data, axis=axis, descending=bool(attr.get("largest", 1)),
                                         dtype="int64"))
        if isinstance(k, relax.ShapeExpr):  # k folded to a symbolic expression at import
            indices = bb.emit(relax.op.strided_slice(order, axes=[axis], begin=[0], end=[k.values[0]]))
        else:
            first_k = runtime_arange(bb, relax.op.astype(k, "int64"), "topk_k")
            indices = bb.emit(relax.op.take(order, first_k, axis=axis))
        values = bb.emit(relax.op.gather_elements(data, indices, axis=axis))
        return relax.Tuple([values, indices])


class Resize(onnx_frontend.Resize):
    """Resize to sizes, or by scales, computed at run time (2-D, NCHW)."""

    @classmethod
    def _impl_v18(cls, bb, inputs, attr, params):
        data = inputs[0]
        scales = get_constant(inputs[2], params) if len(inputs) > 2 and inputs[2] is not None else None
        sizes = get_constant(inputs[3], params) if len(inputs) > 3 and inputs[3] is not None else None
        roi = get_constant(inputs[1], params) if len(inputs) > 1 and inputs[1] is not None else None
        runtime_sizes = isinstance(sizes, relax.ShapeExpr) and not all(
            isinstance(v, tirx.IntImm) for v in sizes.values)
        if not (is_runtime_tensor(sizes) or is_runtime_tensor(scales) or runtime_sizes):
            return super()._impl_v18(bb, inputs, attr, params)
        if len(data.ty.shape.values) != 4 or is_runtime_tensor(roi):
            raise ValueError("run-time Resize sizes are supported for 4-D NCHW inputs with a constant roi")
        if isinstance(sizes, relax.ShapeExpr):
            size = relax.ShapeExpr(sizes.values[2:])
        else:
            if sizes is None:
                input_shape = bb.emit(relax.op.astype(_shape_tensor(bb, data), "float32"))
                sizes = relax.op.floor(relax.op.multiply(input_shape, relax.op.astype(scales, "float32")))
            spatial = relax.op.strided_slice(relax.op.astype(sizes, "int64"), axes=[0], begin=[2], end=[4])
            size = runtime_shape(bb, bb.emit(spatial))
        mode = attr.get("mode", b"nearest").decode("ascii")
        roi_values = roi.value.numpy().tolist() if isinstance(roi, tvm.ir.GenericConst) else []
        resized = relax.op.image.resize2d(
            data, size=size,
            roi=roi_values[2:4] + roi_values[6:8] if len(roi_values) == 8 else [0.0] * 4,
            layout="NCHW", method="nearest_neighbor" if mode == "nearest" else mode,
            coordinate_transformation_mode=attr.get("coordinate_transformation_mode", b"half_pixel").decode("ascii"),
            rounding_method=attr.get("nearest_mode", b"round_prefer_floor").decode("ascii"),
            cubic_alpha=attr.get("cubic_coeff_a", -0.75), cubic_exclude=attr.get("exclude_outside", 0),
            extrapolation_value=attr.get("extrapolation_value", 0.0),
        )
        return named_dims(bb, bb.emit(resized), "resize_dim")


class Slice(onnx_frontend.Slice):
    """Slice with starts, ends, axes or steps given at run time: every dim is a `take` of
    start + step * arange(count), ONNX's clamping done in the tensor domain (dims not sliced
    take their whole range). TVM's own path lowers to dynamic_strided_slice, whose shape function
    the constant folding before legalization loses."""

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        data = inputs[0]
        starts, ends, axes, steps = [
            get_constant(inputs[i], params) if len(inputs) > i and inputs[i] is not None else None
            for i in (1, 2, 3, 4)]
        if (not any(is_runtime_tensor(value) for value in (starts, ends, axes, steps))
                or isinstance(data, relax.ShapeExpr) or not isinstance(data.ty.shape, relax.ShapeExpr)):
            return super()._impl_v13(bb, inputs, attr, params)
        rank = len(data.ty.shape.values)

        def int64(value):
            return relax.const(value, "int64")

        shape = bb.emit(relax.op.shape_to_tensor(relax.op.shape_of(data)))
        if axes is None:
            axes = int64(list(range(int(starts.ty.shape.values[0]))))
        axes = relax.op.astype(axes, "int64")
        axes = bb.emit(relax.op.where(relax.op.less(axes, int64(0)), relax.op.add(axes, int64(rank)), axes))

        def full(defaults, values):  # per-dim vector: the given values at `axes`, defaults elsewhere
            if values is None:
                return defaults
            return bb.emit(relax.op.scatter_elements(defaults, axes, relax.op.astype(values, "int64")))

        all_starts = full(int64([0] * rank), starts)
        all_ends = full(shape, ends)
        all_steps = full(int64([1] * rank), steps)
        result = data
        for axis in range(rank):
            def at(vector):
                return bb.emit(relax.op.take(vector, int64(axis), axis=0))

            dim, start, end, step = at(shape), at(all_starts), at(all_ends), at(all_steps)
            positive = relax.op.greater(step, int64(0))
            last = relax.op.subtract(dim, int64(1))
            start = relax.op.where(relax.op.less(start, int64(0)), relax.op.add(start, dim), start)
            end = relax.op.where(relax.op.less(end, int64(0)), relax.op.add(end, dim), end)
            start = relax.op.minimum(relax.op.maximum(start, int64(0)), relax.op.where(positive, dim, last))
            end = relax.op.minimum(relax.op.maximum(end, relax.op.where(positive, int64(0), int64(-1))),
                                   relax.op.where(positive, dim, last))
            start, end = bb.emit(start), bb.emit(end)
            toward = relax.op.subtract(step, relax.op.where(positive, int64(1), int64(-1)))
            length = relax.op.maximum(
                relax.op.floor_divide(relax.op.add(relax.op.subtract(end, start), toward), step), int64(0))
            offsets = runtime_arange(bb, bb.emit(length), f"slice_axis{axis}_")
            indices = bb.emit(relax.op.add(start, relax.op.multiply(step, offsets)))
            result = bb.emit(relax.op.take(result, indices, axis=axis))
        return result


def shape_values(bb: relax.BlockBuilder, value) -> list | None:
    """The elements of `value` as shape values, if it is a shape in disguise: a ShapeExpr, an
    int64 constant vector, or (through int64 casts) `shape_to_tensor` of a ShapeExpr."""
    while isinstance(value, relax.Var):
        bound = bb.lookup_binding(value)
        if bound is None:
            return None
        value = bound
    if isinstance(value, relax.ShapeExpr):
        return list(value.values)
    if isinstance(value, tvm.ir.GenericConst) and value.ty.ndim == 1 and value.ty.dtype == "int64":
        return value.value.numpy().tolist()
    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
        if value.op.name == "relax.shape_to_tensor":
            return shape_values(bb, value.args[0])
        if value.op.name == "relax.astype" and value.attrs.dtype == "int64":
            return shape_values(bb, value.args[0])
    return None


class Concat(onnx_frontend.Concat):
    """Concatenation of shape pieces stays a shape when every piece is one (possibly converted to
    a tensor on the way), so that the Reshape or Resize it feeds keeps symbolic dims."""

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        pieces = [shape_values(bb, value) for value in inputs]
        if all(piece is not None for piece in pieces) and any(
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


CONVERTERS = {"Reshape": Reshape, "TopK": TopK, "Resize": Resize, "Concat": Concat, "Slice": Slice}
