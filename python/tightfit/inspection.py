"""What a user sees of a model before compiling it: the pipeline, and the imported ops.

Used by `tightfit inspect` and by notebooks; every function returns plain data (lists of dicts)
that prints as a table or serializes as JSON.
"""

from __future__ import annotations

import tvm
from tvm import relax

from .pipeline import PipelineOptions, pass_name, passes
from .target import CompileTarget


def pipeline_table(target: CompileTarget, options: PipelineOptions = PipelineOptions()) -> list[dict]:
    return [{"step": index, "pass": pass_name(p)}
            for index, p in enumerate(passes(target, options), start=1)]


def op_table(mod: tvm.IRModule, function: str = "main") -> list[dict]:
    """One row per operator call in `function`: binding, op, input and output shapes, dtype."""
    rows: list[dict] = []

    @relax.expr_functor.visitor
    class _Collector(relax.PyExprVisitor):
        def visit_var_binding_(self, binding):
            value = binding.value
            if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
                rows.append({
                    "binding": binding.var.name,
                    "op": value.op.name.removeprefix("relax."),
                    "inputs": [describe_type(arg.ty) for arg in value.args
                               if isinstance(arg, relax.Expr) and not isinstance(arg.ty, relax.FuncType)],
                    "output": describe_type(binding.var.ty),
                    "dtype": getattr(binding.var.ty, "dtype", ""),
                })
            self.visit_expr(value)

    _Collector().visit_expr(mod[function])
    return rows


def describe_type(ty) -> str:
    """A short spelling of a Relax type: `(n, 3, 32, 32)`, `shape(n, 4)`, `ndim=2`, tuples."""
    if isinstance(ty, relax.TensorType):
        if ty.shape is not None and isinstance(ty.shape, relax.ShapeExpr):
            return "(" + ", ".join(_dim(d) for d in ty.shape.values) + ")"
        return f"ndim={ty.ndim}" if ty.ndim >= 0 else "?"
    if isinstance(ty, relax.ShapeType):
        if ty.values is not None:
            return "shape(" + ", ".join(_dim(v) for v in ty.values) + ")"
        return f"shape(ndim={ty.ndim})"
    if isinstance(ty, relax.TupleType):
        return "[" + ", ".join(describe_type(field) for field in ty.fields) + "]"
    if isinstance(ty, tvm.ir.PrimType):
        return f"prim {ty.dtype}"
    return type(ty).__name__


def format_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """Rows as an aligned text table (lists are joined with ', ')."""
    if not rows:
        return "(empty)"
    columns = columns or list(rows[0])
    cells = [[_cell(row.get(column, "")) for column in columns] for row in rows]
    widths = [max(len(column), *(len(line[i]) for line in cells)) for i, column in enumerate(columns)]
    lines = ["  ".join(column.ljust(width) for column, width in zip(columns, widths)),
             "  ".join("-" * width for width in widths)]
    lines += ["  ".join(value.ljust(width) for value, width in zip(line, widths)) for line in cells]
    return "\n".join(line.rstrip() for line in lines)


def _cell(value) -> str:
    if isinstance(value, (list, tuple)):
        return ", ".join(str(item) for item in value)
    return str(value)


def _dim(value) -> str:
    return str(value.value) if isinstance(value, tvm.tirx.IntImm) else str(value)
