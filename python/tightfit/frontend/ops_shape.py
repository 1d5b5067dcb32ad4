"""Converters for ops whose output shape comes from a tensor computed at run time.

TVM 0.27's importer requires the shape-giving input of these ops to be a constant or a
`ShapeExpr` it could fold at import time, and fails otherwise ("Reshape requires the input new
shape to be Shape", "TopK k must be a constant", `int(val.value)` on a symbolic Resize size).
Exported models compute such inputs in the graph (PyTorch's `x.reshape(batch, -1)`, `k = n // 4`,
`F.interpolate(size=other.shape[-2:])`), and the ONNX backend tests pass them as graph inputs.

The common tool is `runtime_values`: an int64 vector tensor becomes a `ShapeExpr` of fresh
symbolic variables bound by `match_cast` (checked when the model runs), which every Relax op that
takes a shape accepts. Each class subclasses TVM's converter and hands the cases TVM handles back
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


def runtime_values(bb: relax.BlockBuilder, vector: relax.Expr, name: str) -> list[tirx.Var]:
    """The elements of a 1-D integer tensor of static length as symbolic variables."""
    length = vector.ty.shape.values[0] if vector.ty.shape is not None else None
    if not isinstance(length, tirx.IntImm):
        raise ValueError(f"{name} must have a static length to become a shape")
    as_int64 = vector if vector.ty.dtype == "int64" else bb.emit(relax.op.astype(vector, "int64"))
    symbols = [tirx.Var(f"{name}{index}", "int64") for index in range(int(length))]
    shape = bb.emit(relax.op.tensor_to_shape(as_int64))
    bb.match_cast(shape, relax.ShapeType(symbols))
    return symbols


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
        return relax.op.reshape(data, relax.ShapeExpr(runtime_values(bb, target, "reshape_dim")))


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
        if isinstance(k, relax.ShapeExpr):  # k folded to a symbolic expression at import
            k_symbol = k.values[0]
        else:
            (k_symbol,) = runtime_values(bb, bb.emit(relax.op.reshape(k, [1])), "topk_k")
        order = bb.emit(relax.op.argsort(data, axis=axis, descending=bool(attr.get("largest", 1)),
                                         dtype="int64"))
        indices = bb.emit(relax.op.strided_slice(order, axes=[axis], begin=[0], end=[k_symbol]))
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
            height, width = sizes.values[2:]
        elif sizes is not None:
            height, width = runtime_values(bb, sizes, "resize_size")[2:]
        else:
            input_shape = bb.emit(relax.op.astype(_shape_tensor(bb, data), "float32"))
            scaled = relax.op.floor(relax.op.multiply(input_shape, relax.op.astype(scales, "float32")))
            height, width = runtime_values(bb, bb.emit(relax.op.astype(scaled, "int64")), "resize_size")[2:]
        mode = attr.get("mode", b"nearest").decode("ascii")
        roi_values = roi.value.numpy().tolist() if isinstance(roi, tvm.ir.GenericConst) else []
        return relax.op.image.resize2d(
            data, size=relax.ShapeExpr([height, width]),
            roi=roi_values[2:4] + roi_values[6:8] if len(roi_values) == 8 else [0.0] * 4,
            layout="NCHW", method="nearest_neighbor" if mode == "nearest" else mode,
            coordinate_transformation_mode=attr.get("coordinate_transformation_mode", b"half_pixel").decode("ascii"),
            rounding_method=attr.get("nearest_mode", b"round_prefer_floor").decode("ascii"),
            cubic_alpha=attr.get("cubic_coeff_a", -0.75), cubic_exclude=attr.get("exclude_outside", 0),
            extrapolation_value=attr.get("extrapolation_value", 0.0),
        )


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
        if isinstance(joined, relax.Call) and bb.normalize(joined).ty.shape is None:
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


CONVERTERS = {"Reshape": Reshape, "TopK": TopK, "Resize": Resize, "Concat": Concat}
