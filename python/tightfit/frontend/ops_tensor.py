"""Tensor-manipulation ops whose TVM 0.27 converters stop short of the ONNX specification.

- `Split` with its sizes given as a tensor computed in the graph (opset 13+; TVM: "Dynamic Split
  not yet supported"). ONNX's RotaryEmbedding function body and exporters that split by a
  computed head size produce them. Sizes traced to the input's dims (shape_values: the head
  size from Shape, minus the rotated part) make each output a strided slice whose length is
  known when compiling; sizes known only at run time make it a `take` of offset + arange(size)
  along the axis, its length a fresh symbol bound at run time.
- `Split` into `num_outputs` parts that do not divide the axis (opset 18): every part but the
  last has ceil(dim / num_outputs) elements; TVM asks for equal parts.
- `EyeLike` with a `dtype` attribute: the output has that element type, whatever the input's;
  TVM's converter refuses one that differs from the input's, and TVM's legalization of
  `eye_like` drops its dtype (the kernel makes the input's), so the ones and zeros are cast.
- `Trilu` whose diagonal offset `k` is a graph input: TVM's converter builds its mask from
  nested calls it never binds and fails ("the type is not populated"); here one kernel reads
  `k` and keeps each element on its side of the diagonal.
- `OneHot` whose depth or on/off values are fed at run time (TVM: "Only constant depth
  currently supported"): the depth is bound to a symbol when the model runs and one kernel
  writes the on value where an index (negative ones counted from the end) equals the position
  along the new axis, the off value elsewhere, as onnxruntime does for an index out of range.
- `AffineGrid` whose output size is fed at run time (TVM: "Dynamic size ... is not
  supported"; its kernel takes static sizes only): the size's values are bound to symbols when
  the model runs, and one kernel maps each output position's normalized coordinates (x along
  the width, then y, then z) through theta, as onnx's reference does.
"""

from __future__ import annotations

import functools
import operator

from tvm import relax, te, tirx
from tvm.relax.frontend.onnx import onnx_frontend
from tvm.relax.frontend.onnx.onnx_frontend import get_constant, get_type

from .ops_gather import take_in_range
from .ops_shape import is_runtime_tensor, runtime_arange, runtime_symbols
from .shape_values import shape_values


class Split(onnx_frontend.Split):
    """Split by sizes known only at run time, or into uneven `num_outputs` parts."""

    @classmethod
    def _impl_v13(cls, bb, inputs, attr, params):
        data = inputs[0]
        sizes = get_constant(inputs[1], params) if len(inputs) > 1 and inputs[1] is not None else None
        axis = attr.get("axis", 0) % data.ty.ndim
        if is_runtime_tensor(sizes) and sizes.ty.ndim == 1:
            traced = shape_values(bb, sizes)
            if traced is not None and all(size is not None for size in traced):
                return cls._split_by_traced_sizes(bb, data, traced, axis)
            return cls._split_at_run_time(bb, data, sizes, axis, attr["tvm_custom"]["num_outputs"])
        parts = attr.get("num_outputs")
        dim = data.ty.shape.values[axis] if data.ty.shape is not None else None
        if sizes is None and parts is not None and isinstance(dim, tirx.IntImm) and int(dim) % parts:
            chunk = -(-int(dim) // parts)
            return relax.op.split(data, [chunk * (part + 1) for part in range(parts - 1)], axis)
        return super()._impl_v13(bb, inputs, attr, params)

    @staticmethod
    def _split_by_traced_sizes(bb, data, sizes: list, axis: int) -> relax.Tuple:
        parts, start = [], tirx.const(0, "int64")
        for size in sizes:
            end = start + size
            parts.append(bb.emit(relax.op.strided_slice(data, axes=[axis], begin=[start], end=[end])))
            start = end
        return relax.Tuple(parts)

    @staticmethod
    def _split_at_run_time(bb, data, sizes, axis: int, outputs: int) -> relax.Tuple:
        sizes = bb.emit(relax.op.astype(sizes, "int64"))
        ends = bb.emit(relax.op.cumsum(sizes, axis=0))
        parts = []
        for part in range(outputs):
            index = relax.const(part, "int64")
            length = take_in_range(sizes, index, 0)
            start = relax.op.subtract(take_in_range(ends, index, 0), length)
            offsets = runtime_arange(bb, bb.emit(length), f"split{part}_")
            parts.append(bb.emit(take_in_range(data, relax.op.add(offsets, start), axis)))
        return relax.Tuple(parts)


class EyeLike(onnx_frontend.EyeLike):
    """An identity-like matrix of the `dtype` attribute's type, else of the input's."""

    @classmethod
    def _impl_v9(cls, bb, inputs, attr, params):
        eye = relax.op.eye_like(inputs[0], attr.get("k", 0))
        dtype = get_type(attr["dtype"]) if "dtype" in attr else str(inputs[0].ty.dtype)
        return eye if dtype == str(inputs[0].ty.dtype) else relax.op.astype(bb.emit(eye), dtype)


class Trilu(onnx_frontend.Trilu):
    """The triangle by a diagonal offset read when the model runs, else TVM's."""

    @classmethod
    def _impl_v14(cls, bb, inputs, attr, params):
        offset = get_constant(inputs[1], params) if len(inputs) > 1 and inputs[1] is not None else None
        if not is_runtime_tensor(offset):
            return super()._impl_v14(bb, inputs, attr, params)
        upper = bool(attr.get("upper", True))
        return bb.emit_te(lambda data, k: _triangle(data, k, upper), inputs[0], offset,
                          primfunc_name_hint="trilu")


def _triangle(data: te.Tensor, offset: te.Tensor, upper: bool) -> te.Tensor:
    def value(*index):
        above_by = tirx.Cast("int64", index[-1]) - tirx.Cast("int64", index[-2])  # column - row
        k = tirx.Cast("int64", offset[()])
        keep = above_by >= k if upper else above_by <= k
        return tirx.if_then_else(keep, data[index], tirx.const(0, data.dtype))

    return te.compute(data.shape, value, name="trilu")


class OneHot(onnx_frontend.OneHot):
    """Depth and values read when the model runs, else TVM's."""

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        indices, depth, values = inputs[0], get_constant(inputs[1], params), get_constant(inputs[2], params)
        if not (is_runtime_tensor(depth) or is_runtime_tensor(values)):
            return super()._impl_v11(bb, inputs, attr, params)
        axis = attr.get("axis", -1) % (indices.ty.ndim + 1)
        depth_vector = bb.emit(relax.op.reshape(relax.op.astype(depth, "int64"), [1]))
        classes, = runtime_symbols(bb, depth_vector, "one_hot_depth")
        return bb.emit_te(lambda index, value, depth_dim: _one_hot(index, value, depth_dim, axis),
                          indices, values, classes, primfunc_name_hint="one_hot")


def _one_hot(indices: te.Tensor, values: te.Tensor, depth, axis: int) -> te.Tensor:
    shape = [*indices.shape[:axis], depth, *indices.shape[axis:]]

    def value(*position):
        index = tirx.Cast("int64", indices(*position[:axis], *position[axis + 1:]))
        index = tirx.if_then_else(index < 0, index + depth, index)
        return tirx.if_then_else(index == position[axis], values[1], values[0])

    return te.compute(shape, value, name="one_hot")


class AffineGrid(onnx_frontend.AffineGrid):
    """A grid of a size read when the model runs, else TVM's."""

    @classmethod
    def _impl_v20(cls, bb, inputs, attr, params):
        size = get_constant(inputs[1], params)
        if not is_runtime_tensor(size):
            return super()._impl_v20(bb, inputs, attr, params)
        dims = runtime_symbols(bb, bb.emit(relax.op.astype(size, "int64")), "affine_grid_size")
        align_corners = bool(attr.get("align_corners", 0))
        return bb.emit_te(lambda theta, *spatial: _affine_grid(theta, list(spatial), align_corners),
                          inputs[0], *dims[2:], primfunc_name_hint="affine_grid")


def _affine_grid(theta: te.Tensor, spatial: list, align_corners: bool) -> te.Tensor:
    """grid[n, (d,) h, w] = theta[n] @ (x_w, y_h, (z_d,) 1): normalized coordinates in [-1, 1],
    pixel centres unless `align_corners` (then the end pixels, and -1 for an extent of 1)."""
    dtype = theta.dtype

    def coordinate(position, extent):
        position, extent = tirx.Cast(dtype, position), tirx.Cast(dtype, extent)
        if not align_corners:
            return (position * 2 + 1) / extent - 1
        return tirx.if_then_else(extent > 1, position * 2 / (extent - 1) - 1, tirx.const(-1, dtype))

    def value(n, *position_and_axis):
        *position, axis = position_and_axis
        base = [coordinate(position[-1 - j], spatial[-1 - j]) for j in range(len(spatial))]
        return functools.reduce(operator.add, [theta[n, axis, j] * base[j] for j in range(len(base))],
                                theta[n, axis, len(base)])

    return te.compute([theta.shape[0], *spatial, len(spatial)], value, name="affine_grid")


CONVERTERS = {"Split": Split, "EyeLike": EyeLike, "Trilu": Trilu, "OneHot": OneHot,
              "AffineGrid": AffineGrid}
