"""The value lattice of Rank and Dimension Propagation (SoD2 §4.1, Fig. 2 and Table 4).

A dim, a rank, or an element of a shape-carrying tensor is one of
- `UNDEF` (top: nothing derived yet),
- a TIR expression: a known constant (`IntImm`), a symbolic constant (an input symbol), or an
  op-inferred expression of symbols,
- `NAC` (bottom: not a constant — decided by execution).
Facts about a tensor are the product of these (rank × dims × element values), `Fact` below.

Two ways to combine two facts about the same tensor:
- `merge` (SoD2's Merge, at `If` joins): the facts hold on different paths, so only what both say
  survives — the lattice meet; different values give NAC.
- `refine`: the facts hold on the same execution (one derived forward from the producer, one
  backward from a consumer), so both are true and the more informative wins: UNDEF and NAC give
  way to a value; a constant beats an expression; an expression of input symbols beats one that
  needs a symbol bound at run time (a "cut symbol", below). Two different expressions that must
  both hold are an equality the run requires: when one side is a cut symbol it is *solved*
  (substituted from then on), otherwise the equality is recorded.
Every fact is a statement about every run that completes without error; RDP's soundness rests on
each transfer function mapping true statements to true statements.

Symbols come in two sorts. *Input symbols* are the dims of the function's parameters (`batch`,
`sequence`): known before the run starts — SoD2's symbolic constants. *Cut symbols* are bound
inside the body by `match_cast` (the importer names a data-dependent dim this way, e.g. NonZero's
count): their value exists only once execution reaches them, so a dim that needs one counts as NAC
(SoD2 partitions the graph there), yet the name keeps the relations inside the sub-graph after the
cut (`nonzero_numbers * 2`). Symbols are dims, so they are ≥ 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import tvm
import tvm_ffi
from tvm import tirx

# Shape-carrying tensors: integer tensors of at most this many elements have element values.
MAX_VALUE_ELEMENTS = 16


class _Marker:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


UNDEF = _Marker("undef")
NAC = _Marker("nac")


def is_expr(value) -> bool:
    """A scalar TIR expression (in TVM 0.27 every expression is a `tvm.ir.Expr`; scalars have a
    PrimType)."""
    return isinstance(value, tvm.ir.Expr) and isinstance(value.ty, tvm.ir.PrimType)


def dtype_of(expr) -> str:
    return str(expr.ty.dtype)


@dataclass(frozen=True)
class Fact:
    """What RDP knows about one value.

    kind: "undef" (nothing yet), "tensor", "shape" (a Relax shape value), "prim" (a scalar),
    "tuple", or "object" (anything else: nothing to know).
    rank: tensor rank, or the number of values of a shape; an int, UNDEF or NAC.
    dims: a tensor's dims (len == rank when rank is an int).
    values: the elements (row-major) of a shape-carrying tensor, a shape's values, a prim's value;
    None when not tracked.
    """

    kind: str = "undef"
    rank: object = UNDEF
    dims: tuple = ()
    values: tuple | None = None
    fields: tuple = ()
    dtype: str = ""


UNDEF_FACT = Fact()
OBJECT_FACT = Fact("object")


def tensor_fact(dims, dtype: str = "", values=None) -> Fact:
    dims = tuple(dims)
    return Fact("tensor", len(dims), dims, None if values is None else tuple(values), dtype=dtype)


def unknown_rank_tensor(dtype: str = "") -> Fact:
    return Fact("tensor", NAC, (), None, dtype=dtype)


def shape_fact(values) -> Fact:
    values = tuple(values)
    return Fact("shape", len(values), (), values)


def prim_fact(value, dtype: str = "") -> Fact:
    return Fact("prim", 0, (), (value,), dtype=dtype)


def tuple_fact(fields) -> Fact:
    return Fact("tuple", fields=tuple(fields))


@dataclass
class SymbolTable:
    """The symbols of one function: which are inputs, where cut symbols are bound, and the cut
    symbols solved so far (with the equalities the run requires that solved nothing)."""

    inputs: set
    definition: dict = field(default_factory=dict)  # cut symbol -> (binding order, scope path)
    solved: dict = field(default_factory=dict)  # cut symbol -> expression
    equalities: list = field(default_factory=list)  # (lhs, rhs, where) kept, not solved
    revision: int = 0  # bumped whenever `solved` grows: every fact may simplify further
    derivation_scope: tuple = ()  # the If branches around the binding whose facts are derived now

    def __post_init__(self):
        self.analyzer = tvm.sym.Analyzer()
        self._bounded: set = set()

    # --- expressions ---------------------------------------------------------------------------
    def free_symbols(self, expr) -> list:
        return list(tirx.analysis.undefined_vars(expr))

    def _bound(self, expr) -> None:
        for var in self.free_symbols(expr):
            if var not in self._bounded:
                self._bounded.add(var)
                self.analyzer.update(var, tvm.sym.ConstIntBound(0, tvm.sym.ConstIntBound.POS_INF))

    def normalize(self, value):
        """`value` with solved cut symbols substituted, simplified; markers pass through."""
        if not is_expr(value):
            return value
        if self.solved and any(var in self.solved for var in self.free_symbols(value)):
            substitution = tvm.sym.Analyzer()
            for var, expr in self.solved.items():
                substitution.bind(var, expr)
            value = substitution.simplify(value)
        self._bound(value)
        return self.analyzer.simplify(value)

    def equal(self, a, b) -> bool:
        if not (is_expr(a) and is_expr(b)):
            return a is b
        if dtype_of(a) != dtype_of(b):
            a, b = tirx.Cast("int64", a), tirx.Cast("int64", b)
        self._bound(a)
        self._bound(b)
        return bool(self.analyzer.can_prove_equal(a, b))

    def _equal_when_nonempty(self, a, b) -> bool:
        analyzer = tvm.sym.Analyzer()
        for var in set(self.free_symbols(a)) | set(self.free_symbols(b)):
            analyzer.update(var, tvm.sym.ConstIntBound(1, tvm.sym.ConstIntBound.POS_INF))
        return bool(analyzer.can_prove_equal(a, b))

    def prove(self, condition) -> bool:
        self._bound(condition)
        return bool(self.analyzer.can_prove(condition))

    def is_cut(self, var) -> bool:
        return var in self.definition and var not in self.solved

    def needs_cut(self, expr) -> bool:
        return any(self.is_cut(var) for var in self.free_symbols(expr))

    def kind(self, value) -> str:
        """SoD2's categories: constant, symbolic (one input symbol), expression, or nac."""
        if not is_expr(value):
            return "nac"
        value = self.normalize(value)
        if isinstance(value, tirx.IntImm):
            return "constant"
        if self.needs_cut(value) or not self.free_symbols(value):
            return "nac" if self.needs_cut(value) else "expression"
        return "symbolic" if isinstance(value, tirx.Var) else "expression"

    def _preference(self, value) -> int:
        if isinstance(value, tirx.IntImm):
            return 0
        return 2 if self.needs_cut(value) else 1

    def in_scope(self, expr, at) -> bool:
        """Every cut symbol of `expr` is bound before `at` = (binding order, scope path)."""
        for var in self.free_symbols(expr):
            if var in self.definition:
                order, path = self.definition[var]
                if order >= at[0] or path != at[1][:len(path)]:
                    return False
            elif var not in self.inputs:
                return False
        return True

    # --- combining dims ------------------------------------------------------------------------
    def merge_dim(self, a, b):
        if a is UNDEF:
            return b
        if b is UNDEF:
            return a
        if a is NAC or b is NAC:
            return NAC
        return a if self.equal(a, b) else NAC

    def refine_dim(self, a, b, where: str = ""):
        if a is UNDEF or a is NAC:
            return self.normalize(b) if is_expr(b) else (a if b is UNDEF else b)
        if not is_expr(b):
            return a
        a, b = self.normalize(a), self.normalize(b)
        if not self.equal(a, b):
            self._solve(a, b, where)
            a, b = self.normalize(a), self.normalize(b)
        return b if self._preference(b) < self._preference(a) else a

    def _solve(self, a, b, where: str) -> None:
        for symbol, other in ((a, b), (b, a)):
            if isinstance(symbol, tirx.Var) and self.is_cut(symbol):
                # a fact derived inside an If branch holds only in runs that take it: it may
                # solve a symbol bound in that branch, never one bound outside
                bound_in = self.definition[symbol][1]
                if bound_in[:len(self.derivation_scope)] != self.derivation_scope:
                    continue
                if isinstance(other, tirx.Var) and self.is_cut(other):
                    # both bound at run time: express the later one by the earlier one
                    if self.definition[other][0] > self.definition[symbol][0]:
                        continue
                if symbol in self.free_symbols(other) or not self.in_scope(other, self.definition[symbol]):
                    continue
                self.solved[symbol] = other
                self.revision += 1
                return
        if isinstance(a, tirx.IntImm) and isinstance(b, tirx.IntImm):
            return  # a contradiction: no run gets here; the first fact is kept
        if self.derivation_scope:
            return  # holds only in the runs that take some If branch: not worth stating
        if self._equal_when_nonempty(a, b):
            return  # e.g. truncated and floored division of `time - 1`: differ only at time 0
        if not any(self.equal(a, x) and self.equal(b, y) or self.equal(a, y) and self.equal(b, x)
                   for x, y, _ in self.equalities):
            self.equalities.append((a, b, where))

    # --- combining facts -----------------------------------------------------------------------
    def merge(self, a: Fact, b: Fact) -> Fact:
        if a.kind == "undef":
            return b
        if b.kind == "undef":
            return a
        if a.kind != b.kind:
            return OBJECT_FACT
        if a.kind == "tuple":
            if len(a.fields) != len(b.fields):
                return OBJECT_FACT
            return tuple_fact(self.merge(x, y) for x, y in zip(a.fields, b.fields))
        rank = a.rank if a.rank == b.rank and isinstance(a.rank, int) else self.merge_dim_marker(a.rank, b.rank)
        if not isinstance(rank, int):
            return replace(a, rank=rank, dims=(), values=None)
        dims = tuple(self.merge_dim(x, y) for x, y in zip(a.dims, b.dims))
        values = None
        if a.values is not None and b.values is not None and len(a.values) == len(b.values):
            values = tuple(self.merge_dim(x, y) for x, y in zip(a.values, b.values))
        return replace(a, rank=rank, dims=dims, values=values)

    @staticmethod
    def merge_dim_marker(a, b):
        if a is UNDEF:
            return b
        if b is UNDEF:
            return a
        return NAC

    def refine(self, a: Fact, b: Fact, where: str = "") -> Fact:
        if b.kind in ("undef", "object"):
            return a if a.kind != "undef" or b.kind == "undef" else b
        if a.kind in ("undef", "object"):
            return self._normalized(b)
        if a.kind != b.kind:
            return a
        if a.kind == "tuple":
            if len(a.fields) != len(b.fields):
                return a
            return tuple_fact(self.refine(x, y, where) for x, y in zip(a.fields, b.fields))
        if not isinstance(a.rank, int):
            return self._normalized(replace(b, dtype=a.dtype or b.dtype)) if isinstance(b.rank, int) else a
        if not isinstance(b.rank, int) or b.rank != a.rank:
            return self._normalized(a)
        dims = tuple(self.refine_dim(x, y, where) for x, y in zip(a.dims, b.dims))
        values = a.values
        if b.values is not None:
            if values is None or len(values) != len(b.values):
                values = tuple(self.normalize(v) for v in b.values) if values is None else values
            else:
                values = tuple(self.refine_dim(x, y, where) for x, y in zip(values, b.values))
        return replace(a, dims=dims, values=values)

    def _normalized(self, fact: Fact) -> Fact:
        if fact.kind == "tuple":
            return tuple_fact(self._normalized(f) for f in fact.fields)
        values = None if fact.values is None else tuple(self.normalize(v) for v in fact.values)
        return replace(fact, dims=tuple(self.normalize(d) for d in fact.dims), values=values)

    def renormalized(self, fact: Fact) -> Fact:
        return self._normalized(fact)

    def same_fact(self, a: Fact, b: Fact) -> bool:
        """Nothing new: equal kinds, ranks and, element by element, provably equal values."""
        if a.kind != b.kind or a.rank is not b.rank and a.rank != b.rank:
            return False
        if a.kind == "tuple":
            return len(a.fields) == len(b.fields) and all(
                self.same_fact(x, y) for x, y in zip(a.fields, b.fields))
        if len(a.dims) != len(b.dims) or (a.values is None) != (b.values is None):
            return False
        pairs = list(zip(a.dims, b.dims)) + list(zip(a.values or (), b.values or ()))
        return all(x is y if not (is_expr(x) and is_expr(y)) else
                   (x.same_as(y) or tvm_ffi.structural_equal(x, y)) for x, y in pairs)


def describe_dim(value, symbols: SymbolTable | None = None) -> str:
    if value is UNDEF:
        return "undef"
    if value is NAC:
        return "nac"
    if symbols is not None:
        value = symbols.normalize(value)
        if symbols.needs_cut(value):
            return f"nac({_text(value)})"
    return _text(value)


def _text(expr) -> str:
    """An expression as TVMScript prints it, without the int64 noise."""
    if isinstance(expr, tirx.IntImm):
        return str(expr.value)
    text = str(expr)
    text = re.sub(r"T\.int64\((-?\d+)\)", r"\1", text)
    return text


def describe_fact(fact: Fact, symbols: SymbolTable | None = None) -> str:
    """`(2, nac)`, `(batch, length // 4)`, `shape[batch, 4]`, `ndim=?`, `[a, b]` for tuples; a
    shape-carrying tensor adds its values: `(2,) = [batch, length]`."""
    if fact.kind == "undef":
        return "undef"
    if fact.kind == "object":
        return "-"
    if fact.kind == "tuple":
        return "[" + ", ".join(describe_fact(f, symbols) for f in fact.fields) + "]"
    if fact.kind == "prim":
        return "prim " + (describe_dim(fact.values[0], symbols) if fact.values else "nac")
    if not isinstance(fact.rank, int):
        return "rank " + repr(fact.rank)
    if fact.kind == "shape":
        values = fact.values or (NAC,) * fact.rank
        return "shape[" + ", ".join(describe_dim(v, symbols) for v in values) + "]"
    text = "(" + ", ".join(describe_dim(d, symbols) for d in fact.dims) + ("," if fact.rank == 1 else "") + ")"
    if fact.values is not None and any(v is not NAC and v is not UNDEF for v in fact.values):
        text += " = [" + ", ".join(describe_dim(v, symbols) for v in fact.values) + "]"
    return text
