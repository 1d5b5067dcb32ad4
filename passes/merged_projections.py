"""Projections of one input that one kernel reads, as one GEMM: FuseAttention's Q, K and V
where a model computes them by three (BERT's separate query, key and value layers).

matmul(x, W_i) (+ b_i) for i in Q, K, V are three GEMMs of N columns each; matmul(x, [W_q W_k
W_v]) (+ [b_q b_k b_v]) is one of 3N, whose weight and bias concatenations are weight-only
bindings that PreTransformWeights computes offline (FlexNN's offline weight transforms), and
which the attention kernel reads through its operands' strided views, each moved to its own
columns of the merged rows. MNN's and ONNX Runtime's transformer optimizers merge the three
projections the same way (their fused QKV weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax, tirx

from ..schedules.kernel_call import WeightOnly
from .strided_views import StridedView


@dataclass(frozen=True)
class Projection:
    input: relax.Expr
    weight: relax.Expr  # [K, columns], weight-only
    bias: relax.Expr | None  # [columns], weight-only
    columns: int


def shared_projections(views: list[StridedView], bindings: dict, users: dict,
                       weight_only: WeightOnly) -> list[Projection] | None:
    """The projections of one input that `views`' distinct sources each are, used by nothing
    but the chain to their view, all with a bias or none; None where they are not."""
    sources = [view.source for view in views]
    # Relax nodes hash and compare by the node: views of one source (heads cut from one QKV
    # projection) already read a single GEMM
    if len(set(sources)) != len(sources) or not all(
            isinstance(source, relax.DataflowVar) and len(users.get(source, [])) == 1
            for source in sources):
        return None
    projections = [_projection(source, bindings, users, weight_only) for source in sources]
    if any(found is None for found in projections):
        return None
    first = projections[0]
    if not all(found.input.same_as(first.input) and (found.bias is None) == (first.bias is None)
               for found in projections):
        return None
    return projections


def emit_merged(builder: relax.BlockBuilder, projections: list[Projection], visit,
                weight_only: WeightOnly) -> relax.Var:
    """The merged projection, its columns in the order of `projections`."""
    name = weight_only.transformed_name(projections[0].weight, "merged")
    weight = builder.emit(relax.op.concat([visit(found.weight) for found in projections], -1),
                          name)
    merged = builder.emit(relax.op.matmul(visit(projections[0].input), weight))
    if projections[0].bias is None:
        return merged
    bias = builder.emit(relax.op.concat([visit(found.bias) for found in projections], 0),
                        weight_only.transformed_name(projections[0].bias, "merged"))
    return builder.emit(relax.op.add(merged, bias))


def view_in_merged(view: StridedView, first_column: int, columns: int,
                   total: int) -> StridedView | None:
    """`view`, of a projection's rows of `columns`, moved to the merged rows of `total`, where
    that projection's start at `first_column` (its source to be replaced by the merged one):
    an axis stepping over whole rows steps over merged rows, an axis within a row keeps its
    stride; None where an axis does neither or the view's columns leave the row."""
    analyzer = tvm.sym.Analyzer()
    row_offset = analyzer.simplify(tirx.floordiv(view.offset, columns))
    column_offset = analyzer.simplify(tirx.floormod(view.offset, columns))
    if not isinstance(column_offset, tirx.IntImm):
        return None
    strides, span = [], int(column_offset)
    for extent, stride in zip(view.shape, view.strides):
        if analyzer.can_prove_equal(tirx.floormod(stride, columns), 0):
            strides.append(analyzer.simplify(tirx.floordiv(stride, columns) * total))
        elif isinstance(stride, tirx.IntImm) and isinstance(extent, tirx.IntImm):
            strides.append(stride)
            span += int(stride) * (int(extent) - 1)
        else:
            return None
    if span >= columns:
        return None
    offset = analyzer.simplify(row_offset * total + column_offset + first_column)
    return StridedView(view.source, offset, view.shape, tuple(strides))


def _projection(source, bindings, users, weight_only) -> Projection | None:
    value, bias = bindings.get(source), None
    if _is_call(value, "relax.add"):
        product, bias = value.args
        if weight_only(product):
            product, bias = bias, product
        if not (weight_only(bias) and len(users.get(product, [])) == 1):
            return None
        value = bindings.get(product)
    if not (_is_call(value, "relax.matmul") and weight_only(value.args[1])):
        return None
    weight = value.args[1]
    weight_shape = _static_dims(weight)
    if weight_shape is None or len(weight_shape) != 2 or len(_static_dims(value.args[0]) or []) < 2:
        return None
    columns = weight_shape[1]
    if columns < 1 or (bias is not None and _static_dims(bias) != [columns]):
        return None
    return Projection(value.args[0], weight, bias, columns)


def _static_dims(expr) -> list[int] | None:
    ty = expr.ty
    if not (isinstance(ty, relax.TensorType) and ty.dtype == "float32"
            and isinstance(ty.shape, relax.ShapeExpr)):
        return None
    dims = ty.shape.values
    return [int(dim) if isinstance(dim, tirx.IntImm) else -1 for dim in dims]


def _is_call(value, op_name: str) -> bool:
    return (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
            and value.op.name == op_name)
