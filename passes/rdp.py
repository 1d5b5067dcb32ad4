"""Rank and Dimension Propagation: what can be known before running about every tensor's rank,
dims and (for shape-carrying tensors) values — and what cannot.

SoD2 §4.1, Algorithm 1. The graph is the Relax function with its `If`s (Switch/Combine); the
lattice is passes/rdp_lattice.py, the transfer functions passes/rdp_transfer.py. Every binding
starts `undef`; a worklist, seeded with all bindings in program order (a topological order),
applies each binding's forward transfer function and then its backward one, and re-queues the
bindings whose inputs or outputs it changed; `If` bindings Merge their two branches' results and
pass their own facts back into both. A cut symbol proven equal to an expression (say, the `k` of
a TopK computed as `length // 4`) is substituted everywhere and the sweep goes on, until nothing
changes. Each step maps true facts to true facts, so the result is sound at every step; the visit
cap (MAX_VISITS_PER_BINDING) only bounds precision, and `tightfit.rdp_converged` says if it hit.

Sound means: in every run that completes without error (every input onnxruntime accepts), each
value has the rank, dims and shape values RDP gives it. Backward facts are requirements of the
consumers (a MatMul needs equal contracted dims), so they hold in such runs. Facts derived inside
an `If` branch hold only in runs that take it: they refine only what that branch binds. On an
input the model rejects, TVM may compute garbage where onnxruntime raises; after RDP a
match_cast that became a check may raise instead — no valid run changes.

What is written back into the IR (no output value changes):
- cut symbols solved to expressions are substituted (`bind_symbolic_vars`): the match_cast that
  bound one becomes a run-time check of the proven value, and every type downstream tightens;
- a binding whose type RDP knows more of (a rank-only NonZero result, an `If` whose branches
  Relax could not reconcile, a broadcast Relax gave up on) gets a `match_cast` to the tighter
  type right after it, a fresh symbol standing for each dim still unknown; its uses move to it;
- function attributes: `tightfit.rdp` (binding name → RDP value, as text), `tightfit.rdp_equalities`
  (the symbolic equalities proven or required), `tightfit.dynamism` (re-classified with what RDP
  knows: an op whose shape-giving input RDP determined moves to its less dynamic class);
- a pure call whose every element RDP knows is bound to that constant instead (the constant part
  of the propagation, SoD2 §4.1): a transformer's attention scale, computed from a static dim of
  a dynamic shape (`take(shape_to_tensor(shape), 2)`), then folds (FoldConstantCalls) instead of
  running as kernels.
Limits: one function at a time (calls to other functions give only their declared type); no
`Loop` (the frontend imports none); values are tracked for integer tensors of at most
MAX_VALUE_ELEMENTS elements; the tightening uses only symbols in scope at the binding.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax, tirx

from .classify_dynamism import (ATTR_KEY as DYNAMISM_ATTR, classify_binding, input_symbols,
                                iter_bindings, with_unique_binding_names)
from .rdp_lattice import NAC, UNDEF_FACT, Fact, SymbolTable, describe_dim, describe_fact, is_expr
from .rdp_transfer import Env, backward, fact_from_type, forward

FACTS_ATTR = "tightfit.rdp"
EQUALITIES_ATTR = "tightfit.rdp_equalities"
CONVERGED_ATTR = "tightfit.rdp_converged"
MAX_VISITS_PER_BINDING = 40


@dataclass
class Node:
    """One binding of the extended graph: its program order and the `If` branches around it."""

    binding: relax.Binding
    order: int
    scope: tuple  # (if binding order, branch) pairs, outermost first
    inputs: list = field(default_factory=list)

    @property
    def var(self):
        return self.binding.var

    @property
    def at(self):
        return (self.order, self.scope)


@dataclass
class RDPResult:
    func: relax.Function
    nodes: list[Node]
    symbols: SymbolTable
    facts: dict  # relax Var -> Fact, parameters included
    classes: dict[str, str]
    converged: bool
    visits: int

    def fact(self, name: str) -> Fact:
        return self._by_name()[name]

    def _by_name(self) -> dict:
        return {var.name: fact for var, fact in self.facts.items()}

    def described(self) -> dict[str, str]:
        return {node.var.name: describe_fact(self.facts[node.var], self.symbols) for node in self.nodes
                if node.var in self.facts}

    def equalities(self) -> list[str]:
        solved = [f"{var} == {describe_dim(self.symbols.normalize(var))}" for var in self.symbols.solved]
        symbols = self.symbols
        kept = [f"{describe_dim(a)} == {describe_dim(b)} (required by {where})"
                for a, b, where in symbols.equalities
                if not symbols.equal(symbols.normalize(a), symbols.normalize(b))]  # not solved since
        return solved + kept


# --- the graph -------------------------------------------------------------------------------------

def build_nodes(func: relax.Function) -> list[Node]:
    nodes: list[Node] = []

    def walk(seq, scope):
        if not isinstance(seq, relax.SeqExpr):
            return
        for block in seq.blocks:
            for binding in block.bindings:
                value = binding.value
                if isinstance(value, relax.If):
                    own_order = len(nodes) + _count_bindings(value)
                    walk(value.true_branch, scope + ((own_order, "then"),))
                    walk(value.false_branch, scope + ((own_order, "else"),))
                nodes.append(Node(binding, len(nodes), scope, _inputs(value)))

    walk(func.body, ())
    return nodes


def _count_bindings(value: relax.If) -> int:
    count = 0
    for branch in (value.true_branch, value.false_branch):
        for block in branch.blocks:
            for binding in block.bindings:
                count += 1 + (_count_bindings(binding.value) if isinstance(binding.value, relax.If) else 0)
    return count


def _inputs(value) -> list:
    if isinstance(value, relax.If):
        used = list(relax.analysis.free_vars(value.cond))
        used += [branch.body for branch in (value.true_branch, value.false_branch)
                 if isinstance(branch.body, relax.Var)]
        return used
    return list(relax.analysis.free_vars(value))


def _symbol_table(func: relax.Function, nodes: list[Node]) -> SymbolTable:
    inputs = input_symbols(func)
    symbols = SymbolTable(inputs)
    for node in nodes:
        if isinstance(node.binding, relax.MatchCast):
            for var in relax.analysis.tir_vars_in_type(node.binding.ty):
                if var not in inputs and var not in symbols.definition:
                    symbols.definition[var] = node.at
    return symbols


# --- the analysis ----------------------------------------------------------------------------------

def analyze(func: relax.Function) -> RDPResult:
    """Run RDP on one function (its binding names must be unique: see ClassifyDynamism)."""
    nodes = build_nodes(func)
    symbols = _symbol_table(func, nodes)
    facts: dict = {param: fact_from_type(param.ty) for param in func.params}
    env = Env(symbols, facts)
    producer = {node.var: node for node in nodes}
    users: dict = {}
    for node in nodes:
        for var in node.inputs:
            users.setdefault(var, []).append(node)

    def scope_of(var) -> tuple:
        return producer[var].scope if var in producer else ()

    queue = deque(nodes)
    queued = set(node.order for node in nodes)
    visits = 0
    limit = MAX_VISITS_PER_BINDING * max(len(nodes), 1)
    revision = symbols.revision

    def push(node):
        if node.order not in queued:
            queued.add(node.order)
            queue.append(node)

    def update(var, fact: Fact, node: Node) -> None:
        # facts derived inside an If branch hold only in runs that take it: they may refine what
        # is bound in that branch (or deeper), never what is bound outside it
        if node.scope != scope_of(var)[:len(node.scope)]:
            return
        old = facts.get(var, UNDEF_FACT)
        # what is known of `var` holds in the runs that reach it: an equality found by combining
        # two such facts may only solve symbols bound where `var` is
        symbols.derivation_scope = scope_of(var)
        new = symbols.refine(old, fact, node.var.name)
        if symbols.same_fact(old, new):
            return
        facts[var] = new
        for user in users.get(var, []):
            push(user)
        if var in producer:
            push(producer[var])

    while queue and visits < limit:
        node = queue.popleft()
        queued.discard(node.order)
        visits += 1
        symbols.derivation_scope = node.scope  # for the solving done inside transfer functions
        update(node.var, _forward(node, env), node)
        for var, fact in _backward(node, env):
            if var in facts or var in producer:
                update(var, fact, node)
        if symbols.revision != revision:
            # a cut symbol was solved: every fact may simplify, every binding may learn more
            revision = symbols.revision
            for var in list(facts):
                facts[var] = symbols.renormalized(facts[var])
            for other in nodes:
                push(other)
    classes = _reclassify(nodes, env)
    return RDPResult(func, nodes, symbols, facts, classes, converged=not queue, visits=visits)


def _forward(node: Node, env: Env) -> Fact:
    value = node.binding.value
    if isinstance(value, relax.If):
        # Merge (SoD2): only what both branches give holds after the join
        merged = env.symbols.merge(env.fact(value.true_branch), env.fact(value.false_branch))
        return env.symbols.refine(fact_from_type(node.var.ty), merged, node.var.name)
    return forward(node.binding, env)


def _backward(node: Node, env: Env) -> list:
    out = env.facts.get(node.var, UNDEF_FACT)
    value = node.binding.value
    if isinstance(value, relax.If):
        # whichever branch ran produced the If's value
        return [(branch.body, out) for branch in (value.true_branch, value.false_branch)
                if isinstance(branch.body, relax.Var)]
    return backward(node.binding, out, env)


def _reclassify(nodes: list[Node], env: Env) -> dict[str, str]:
    symbols = env.symbols

    def is_known(arg) -> bool:
        fact = env.fact(arg)
        if fact.kind == "tuple":
            return all(_fact_known(f, symbols) for f in fact.fields)
        return _fact_known(fact, symbols)

    classes = {}
    for node in nodes:
        dynamism = classify_binding(node.binding.value, is_known)
        if dynamism is not None:
            classes[node.var.name] = dynamism.value
    return classes


def _fact_known(fact: Fact, symbols: SymbolTable) -> bool:
    """A value known before the run: every element an expression of input symbols."""
    if fact.kind == "tensor" and fact.values is None:
        return False
    if fact.kind not in ("tensor", "shape", "prim") or fact.values is None:
        return False
    return all(is_expr(v) and not symbols.needs_cut(symbols.normalize(v)) for v in fact.values)


# --- writing the result back -----------------------------------------------------------------------

def resolved_substitution(symbols: SymbolTable) -> dict:
    """Solved cut symbols, each mapped to an expression free of other solved symbols."""
    return {var: symbols.normalize(var) for var in symbols.solved}


@relax.expr_functor.mutator
class _Tighten(relax.PyExprMutator):
    """After each binding whose type RDP knows more of, a match_cast to the tighter type."""

    def __init__(self, mod, tighter: dict):
        super().__init__(mod)
        self.tighter = tighter  # binding name -> (new var name, type)

    def _after(self, binding):
        if binding.var.name not in self.tighter:
            return
        emitted = self.visit_expr(binding.var)
        name, improve = self.tighter[binding.var.name]
        ty = improve(emitted.ty)  # judged on the type re-inferred from the tightened inputs
        if ty is None:
            return
        fresh = (relax.DataflowVar if isinstance(emitted, relax.DataflowVar) else relax.Var)(name, ty)
        self.builder_.emit_normalized(relax.MatchCast(fresh, emitted, ty))
        self.set_var_remap(binding.var, fresh)

    def visit_var_binding_(self, binding):
        super().visit_var_binding_(binding)
        self._after(binding)

    def visit_match_cast_(self, binding):
        super().visit_match_cast_(binding)
        self._after(binding)


def _tighter_types(func: relax.Function, result: RDPResult) -> dict:
    """Bindings whose (substituted) type RDP improves on, and the match_cast type for each."""
    symbols = result.symbols
    nodes = {node.var.name: node for node in result.nodes}
    facts = result._by_name()
    only_cast = _used_only_by_match_cast(func)
    taken = {binding.var.name for binding in iter_bindings(func)} | {p.name for p in func.params}
    tighter = {}
    for binding in iter_bindings(func):
        name = binding.var.name
        if name not in nodes or name not in facts or name in only_cast:
            continue
        fact = symbols.renormalized(facts[name])
        if _improved_type(fact_from_type(binding.var.ty), fact, binding.var.ty, symbols,
                          nodes[name].at, name) is None:
            continue
        new_name = f"{name}_rdp"
        while new_name in taken:
            new_name += "_"
        taken.add(new_name)
        tighter[name] = (new_name, lambda ty, fact=fact, at=nodes[name].at, name=name: _improved_type(
            fact_from_type(ty), fact, ty, symbols, at, name))
    return tighter


def _improved_type(current: Fact, fact: Fact, ty, symbols: SymbolTable, at, name: str):
    if fact.kind != "tensor" or not isinstance(fact.rank, int) or not isinstance(ty, relax.TensorType):
        return None
    old_dims = current.dims if isinstance(current.rank, int) else (NAC,) * fact.rank
    dims, improved = [], False
    for axis, (old, new) in enumerate(zip(old_dims, fact.dims)):
        usable = is_expr(new) and symbols.in_scope(new, at)
        if is_expr(old):
            dims.append(old)
        elif usable:
            dims.append(new)
            improved = True
        else:
            dims.append(tirx.Var(f"{name}_d{axis}", "int64"))
    if not isinstance(current.rank, int):
        improved = True
    return relax.TensorType(dims, ty.dtype) if improved else None


def _used_only_by_match_cast(func: relax.Function) -> set[str]:
    uses: dict[str, set] = {}
    for binding in iter_bindings(func):
        kind = "cast" if isinstance(binding, relax.MatchCast) else "other"
        value = binding.value
        used = _inputs(value) if isinstance(value, relax.If) else relax.analysis.free_vars(value)
        for var in used:
            uses.setdefault(var.name, set()).add(kind)
    body = func.body.body
    for var in relax.analysis.free_vars(body):
        uses.setdefault(var.name, set()).add("other")
    return {name for name, kinds in uses.items() if kinds == {"cast"}}


@relax.expr_functor.mutator
class _KnownValuesAsConstants(relax.PyExprMutator):
    """Each pure call whose every element RDP knows, bound to that constant instead."""

    def __init__(self, mod, constants: dict):
        super().__init__(mod)
        self.constants = constants  # binding name -> relax constant

    def visit_var_binding_(self, binding):
        value = binding.value
        constant = self.constants.get(binding.var.name)
        if constant is None or not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
                                    and value.op.get_attr("FPurity")):
            super().visit_var_binding_(binding)
            return
        var = (relax.DataflowVar if isinstance(binding.var, relax.DataflowVar) else relax.Var)(
            binding.var.name, constant.ty)
        self.builder_.emit_normalized(relax.VarBinding(var, constant))
        self.set_var_remap(binding.var, var)


def _known_values(func: relax.Function, result: RDPResult) -> dict:
    """The tensors of `func`'s bindings whose every element RDP knows, as constants."""
    facts = result._by_name()
    constants = {}
    for binding in iter_bindings(func):
        fact = facts.get(binding.var.name)
        ty = binding.var.ty
        if fact is None or fact.kind != "tensor" or fact.values is None or not isinstance(ty, relax.TensorType):
            continue
        if not all(isinstance(value, tirx.IntImm) for value in (*fact.dims, *fact.values)):
            continue
        dtype = str(ty.dtype)
        values = np.array([int(value) for value in fact.values], dtype=dtype)
        constants[binding.var.name] = relax.const(values.reshape([int(dim) for dim in fact.dims]), dtype)
    return constants


def write_back(func: relax.Function, result: RDPResult, mod: tvm.IRModule) -> relax.Function:
    substitution = resolved_substitution(result.symbols)
    if substitution:
        func = func.bind_symbolic_vars(substitution)
    tighter = _tighter_types(func, result)
    if tighter:
        func = _Tighten(mod, tighter).visit_expr(func)
    known = _known_values(func, result)
    if known:
        func = _KnownValuesAsConstants(mod, known).visit_expr(func)
    defined = {var: var for var in input_symbols(func)}
    ret_ty = relax.analysis.erase_to_well_defined(func.body.ty, defined)
    func = relax.Function(func.params, func.body, ret_ty, func.is_pure, func.attrs, func.span)
    return (func.with_attr(FACTS_ATTR, result.described())
            .with_attr(EQUALITIES_ATTR, result.equalities())
            .with_attr(DYNAMISM_ATTR, result.classes)
            .with_attr(CONVERGED_ATTR, result.converged))


@tvm.transform.module_pass(opt_level=0, name="tightfit.RankDimensionPropagation")
class RankDimensionPropagation:
    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        result_mod = mod.clone()
        for global_var, func in mod.functions.items():
            if not isinstance(func, relax.Function):
                continue
            func = with_unique_binding_names(func, mod)
            result_mod[global_var] = write_back(func, analyze(func), mod)
        return result_mod


def analyze_module(mod: tvm.IRModule, function: str = "main") -> RDPResult:
    """RDP's facts for one function of `mod`, without rewriting it (for reports and tests)."""
    return analyze(with_unique_binding_names(mod[function], mod))
