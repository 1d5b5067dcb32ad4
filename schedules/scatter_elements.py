"""ONNX ScatterElements as ONNX defines it, for indices of any shape.

TOPI's scatter_elements assumes the indices have the data's shape in every dim but the axis: it
walks the indices by their flat positions and adds those to the data's row offsets. ONNX lets
the indices be shorter in any dim; with a 1x2x1 index block into 1x2x2 data along axis 0, TOPI
wrote the second update to data[0, 0, 1], where ONNX (and onnxruntime) put it at data[0, 1, 0].
This kernel walks the indices by their coordinates, in row-major order, and writes each update
at the same coordinates with the axis's coordinate replaced by the index (a negative index counts
from the end). Updates to one element apply in that order, as in ONNX's reference, so duplicate
indices combine as there. Rows of the indices along the first dim run in parallel, unless the
scatter is along that dim: those rows then write to the same elements.
"""

from __future__ import annotations

import contextlib

from tvm import relax, te, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

SCATTER_OP = "relax.scatter_elements"

# relax's reductions (ONNX's "none" is relax's "update"), each as TOPI computes it
COMBINE = {
    "update": lambda old, new: new,
    "add": lambda old, new: old + new,
    "mul": lambda old, new: old * new,
    "mean": lambda old, new: (old + new) / 2,
    "min": tirx.min,
    "max": tirx.max,
}


def legalize_scatter_elements() -> dict:
    """LegalizeOps' customize map: relax.scatter_elements as the kernel below."""
    return {SCATTER_OP: _legalize}


def _legalize(builder: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    axis, reduction = int(call.attrs.axis), str(call.attrs.reduction)

    def compute(data, indices, updates):
        return scatter_elements(data, indices, updates, axis, reduction)

    return builder.call_te(compute, *call.args, primfunc_name_hint="scatter_elements")


def scatter_elements(data: te.Tensor, indices: te.Tensor, updates: te.Tensor, axis: int,
                     reduction: str) -> te.Tensor:
    rank = len(data.shape)
    axis %= rank
    combine = COMBINE[reduction]

    def body(data_buffer, indices_buffer, updates_buffer, out):
        with IRBuilder() as builder:
            with T.seq_scope():
                with contextlib.ExitStack() as loops:
                    element = _loop_nest(loops, data.shape, parallel_first=True)
                    T.buffer_store(out, data_buffer[tuple(element)], element)
                with contextlib.ExitStack() as loops:
                    position = _loop_nest(loops, indices.shape, parallel_first=axis != 0)
                    index = indices_buffer[tuple(position)]
                    extent = data.shape[axis]
                    index = tirx.Select(index < 0, index + extent.astype(str(indices.dtype)), index)
                    target = [*position[:axis], index.astype(str(extent.ty)), *position[axis + 1:]]
                    T.buffer_store(out, combine(out[tuple(target)], updates_buffer[tuple(position)]), target)
        return builder.get()

    return te.extern([data.shape], [data, indices, updates],
                     lambda ins, outs: body(*ins, outs[0]), dtype=str(data.dtype), name="scatter_elements")


def _loop_nest(loops: contextlib.ExitStack, extents, parallel_first: bool) -> list:
    """The variables of a row-major loop nest over `extents`, its outermost loop parallel or not."""
    return [loops.enter_context((T.parallel if dim == 0 and parallel_first else T.serial)(0, extent))
            for dim, extent in enumerate(extents)]
