"""Compare RDP's facts with what a run observed (`shape_probe`): the soundness check.

A fact's dims and values are TIR expressions over the input symbols (bound from the input
shapes), cut symbols (bound only at run time: each takes the value of its first observation
standing alone, and must then agree everywhere else), or nac/undef (no claim). Expressions are
evaluated here in plain Python, because TVM's simplifier does not fold every float intrinsic
(`floor(3.5)` stays symbolic), and a prediction that cannot be evaluated must not pass silently:
an unbound symbol inside a compound expression is a mismatch unless it is bound later in the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import tvm
from tvm import tirx

P = tvm.ir.prim.expr


class Unbound(Exception):
    """The expression needs a symbol this run has not bound (yet)."""


def evaluate(expr, env: dict):
    """The value of a TIR expression with the symbols in `env` (Var -> int)."""
    if isinstance(expr, tirx.IntImm):
        return bool(expr.value) if _dtype(expr) == "bool" else int(expr.value)
    if isinstance(expr, tirx.FloatImm):
        return float(expr.value)
    if isinstance(expr, tirx.Var):
        if expr not in env:
            raise Unbound(expr.name)
        return env[expr]
    if isinstance(expr, P.Cast):
        return _cast(evaluate(expr.value, env), _dtype(expr))
    if isinstance(expr, P.Not):
        return not evaluate(expr.a, env)
    if isinstance(expr, P.Select):
        return evaluate(expr.true_value if evaluate(expr.condition, env) else expr.false_value, env)
    if isinstance(expr, tvm.ir.expr.Call):
        return _call(expr, env)
    binary = _BINARY.get(type(expr))
    if binary is not None:
        return binary(evaluate(expr.a, env), evaluate(expr.b, env), _dtype(expr))
    raise NotImplementedError(f"cannot evaluate {type(expr).__name__}: {expr}")


def _dtype(expr) -> str:
    return str(expr.ty.dtype)


def _cast(value, dtype: str):
    if dtype == "bool":
        return bool(value)
    if dtype.startswith(("int", "uint")):
        return int(value)  # C casts truncate toward zero
    return float(value)


def _is_int(dtype: str) -> bool:
    return dtype.startswith(("int", "uint"))


def _trunc_div(a, b):
    quotient = abs(a) // abs(b)
    return quotient if (a >= 0) == (b >= 0) else -quotient


_BINARY = {
    P.Add: lambda a, b, t: a + b,
    P.Sub: lambda a, b, t: a - b,
    P.Mul: lambda a, b, t: a * b,
    P.Div: lambda a, b, t: _trunc_div(a, b) if _is_int(t) else a / b,
    P.Mod: lambda a, b, t: a - _trunc_div(a, b) * b if _is_int(t) else math.fmod(a, b),
    P.FloorDiv: lambda a, b, t: a // b if _is_int(t) else math.floor(a / b),
    P.FloorMod: lambda a, b, t: a % b,
    P.Min: lambda a, b, t: min(a, b),
    P.Max: lambda a, b, t: max(a, b),
    P.EQ: lambda a, b, t: a == b,
    P.NE: lambda a, b, t: a != b,
    P.LT: lambda a, b, t: a < b,
    P.LE: lambda a, b, t: a <= b,
    P.GT: lambda a, b, t: a > b,
    P.GE: lambda a, b, t: a >= b,
    P.And: lambda a, b, t: a and b,
    P.Or: lambda a, b, t: a or b,
}

_UNARY_CALLS = {"floor": math.floor, "ceil": math.ceil, "round": round, "trunc": math.trunc,
                "fabs": abs, "abs": abs, "sqrt": math.sqrt, "exp": math.exp, "log": math.log}


def _call(expr, env):
    name = expr.op.name.split(".")[-1]
    if name == "if_then_else":
        condition, then_value, else_value = expr.args
        return evaluate(then_value if evaluate(condition, env) else else_value, env)
    if name in _UNARY_CALLS:
        value = _UNARY_CALLS[name](evaluate(expr.args[0], env))
        return _cast(value, _dtype(expr))
    raise NotImplementedError(f"cannot evaluate the intrinsic {expr.op.name}")


def is_expr(value) -> bool:
    return isinstance(value, tvm.ir.Expr) and isinstance(getattr(value, "ty", None), tvm.ir.PrimType)


@dataclass
class Check:
    """One run's comparison: `env` grows as cut symbols are bound; `mismatches` says what RDP got
    wrong (binding, what, predicted, observed); `compared` counts the claims checked."""

    env: dict
    mismatches: list = field(default_factory=list)
    compared: int = 0
    unchecked: list = field(default_factory=list)

    def claim(self, binding: str, what: str, predicted, observed) -> None:
        if not is_expr(predicted) or observed is None:
            return  # nac / undef: no claim
        if isinstance(predicted, tirx.Var) and predicted not in self.env:
            self.env[predicted] = observed  # a cut symbol's first appearance binds it
            return
        try:
            value = evaluate(predicted, self.env)
        except Unbound:
            self.unchecked.append((binding, what, predicted, observed))
            return
        self.compared += 1
        if not _same(value, observed):
            self.mismatches.append((binding, what, str(predicted), observed))

    def finish(self) -> None:
        """Claims that needed a symbol bound later in the run are checked now."""
        pending, self.unchecked = self.unchecked, []
        for binding, what, predicted, observed in pending:
            try:
                value = evaluate(predicted, self.env)
            except Unbound as missing:
                self.mismatches.append((binding, what, f"{predicted} (symbol {missing} never bound)",
                                        observed))
                continue
            self.compared += 1
            if not _same(value, observed):
                self.mismatches.append((binding, what, str(predicted), observed))


def _same(value, observed) -> bool:
    if isinstance(value, float) or isinstance(observed, float):
        return math.isclose(float(value), float(observed), rel_tol=1e-6, abs_tol=1e-9)
    return int(value) == int(observed)
