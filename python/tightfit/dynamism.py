"""What is known before running a model: dynamism classes and RDP values, tensor by tensor.

For notebooks and `tightfit inspect --rdp`. `understand(model)` runs pipeline phase 1 (import
normalization, ClassifyDynamism, RankDimensionPropagation) and keeps the module before and after
RDP; `rdp_report(model)` turns that into rows — per binding: its op, its class before and after
RDP, its value in the lattice as Relax's own (forward) inference knew it and as RDP knows it — and
SoD2's summary (§5, Fig. 8): how many tensors have constant / symbolic / expression / nac shapes,
how many dims are nac, and how many sub-graphs are all-constant, mixed, or cut by a nac.

Sub-graphs, as SoD2 partitions for execution planning (§4.3): the bindings connected by the
values they pass, cut after every op where a nac arises — an EDO or ISVDOS op (by its class after
RDP) whose result has a dim not known before the run (NonZero's count, a shape computed from
data, an If whose branches disagree). Inside the sub-graph after a cut, the symbol that names the
unknown dim counts as a symbol. A sub-graph is "cut by nac" if it ends in such an op, "all
constant" if every shape in it is a constant, "mixed" otherwise.

The docs page docs/dynamism-classes.md is generated from passes/classify_dynamism.py:
    python -m tightfit.dynamism --write-docs docs/dynamism-classes.md   (or --check-docs)
The nac counts before and after RDP for every zoo model (bench/results/rdp.md):
    python -m tightfit.dynamism --zoo-table bench/results/rdp.md
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnx
import tvm
from tvm import relax

from .frontend import import_onnx
from .frontend.importer import ImportedModel
from .passes.classify_dynamism import (ATTR_KEY, EDO, ISDO, ISDOS, ISVDOS, ONNX_OP_DYNAMISM,
                                       RELAX_OP_DYNAMISM, op_key)
from .passes.rdp import RDPResult, analyze_module
from .passes.rdp_lattice import Fact, SymbolTable, describe_fact
from .passes.rdp_transfer import fact_from_type
from .pipeline import pass_name, passes
from .target import resolve_target

DOCS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "dynamism-classes.md"
CATEGORIES = ("constant", "symbolic", "expression", "nac")
SUBGRAPH_KINDS = ("all constant", "mixed", "cut by nac")


@dataclass
class Understanding:
    """A model after pipeline phase 1: the module RDP got, its analysis, the module it wrote."""

    imported: ImportedModel
    classified: tvm.IRModule
    result: RDPResult
    refined: tvm.IRModule


def understand(model: str | Path | onnx.ModelProto | ImportedModel,
               input_shapes: dict[str, list[int | str]] | None = None) -> Understanding:
    imported = model if isinstance(model, ImportedModel) else import_onnx(model, input_shapes)
    target = resolve_target("host")
    mod, classified = imported.mod, None
    with target.tvm_target, tvm.transform.PassContext(opt_level=3):
        for compiler_pass in passes(target):
            mod = compiler_pass(mod)
            name = pass_name(compiler_pass)
            if name == "tightfit.ClassifyDynamism":
                classified = mod
            if name == "tightfit.RankDimensionPropagation":
                break
    if classified is None:
        raise RuntimeError("the pipeline has no tightfit.ClassifyDynamism pass")
    return Understanding(imported, classified, analyze_module(classified), mod)


# --- the report ------------------------------------------------------------------------------------

@dataclass
class Summary:
    tensors: dict = field(default_factory=dict)  # category -> count of tensor bindings
    nac_dims: int = 0
    nac_shape_values: int = 0  # elements of shape values (R.Shape bindings) not known
    subgraphs: dict = field(default_factory=dict)  # kind -> count


@dataclass
class RDPReport:
    rows: list[dict]
    before: Summary
    after: Summary
    equalities: list[str]
    converged: bool

    def to_json(self) -> dict:
        return asdict(self)


def rdp_report(model) -> RDPReport:
    """Per binding, Relax's knowledge against RDP's; SoD2's summary counts for both."""
    understanding = model if isinstance(model, Understanding) else understand(model)
    result = understanding.result
    symbols = result.symbols
    relax_only = SymbolTable(symbols.inputs, dict(symbols.definition))  # nothing solved
    before_classes = dict(understanding.classified["main"].attrs.get(ATTR_KEY, {}))
    before_facts = {node.var: fact_from_type(node.var.ty) for node in result.nodes}
    after_facts = {node.var: result.facts.get(node.var, before_facts[node.var]) for node in result.nodes}
    rows = []
    for node in result.nodes:
        var = node.var
        rows.append({
            "binding": var.name,
            "op": _op_label(node.binding),
            "class": before_classes.get(var.name, ""),
            "class_after": result.classes.get(var.name, ""),
            "before": describe_fact(before_facts[var], relax_only),
            "after": describe_fact(after_facts[var], symbols),
            "nac_before": nac_dims(before_facts[var], relax_only),
            "nac_after": nac_dims(after_facts[var], symbols),
        })
    return RDPReport(rows, _summary(result, before_facts, relax_only, before_classes),
                     _summary(result, after_facts, symbols, result.classes), result.equalities(),
                     result.converged)


def _op_label(binding) -> str:
    if isinstance(binding, relax.MatchCast):
        return "match_cast"
    key = op_key(binding.value)
    if key is None:
        return type(binding.value).__name__.lower()
    return key.removeprefix("relax.").replace("call_pure_packed:vm.builtin.", "")


def category(fact: Fact, symbols: SymbolTable) -> str | None:
    """SoD2's shape categories for a tensor: constant, symbolic, expression, or nac."""
    if fact.kind != "tensor":
        return None
    if not isinstance(fact.rank, int):
        return "nac"
    kinds = {symbols.kind(dim) for dim in fact.dims}
    for kind in ("nac", "expression", "symbolic"):
        if kind in kinds:
            return kind
    return "constant"


def nac_dims(fact: Fact, symbols: SymbolTable) -> int:
    """Dims not known before the run (an unknown rank counts once); tuples add their fields."""
    if fact.kind == "tuple":
        return sum(nac_dims(field_fact, symbols) for field_fact in fact.fields)
    if fact.kind != "tensor":
        return 0
    if not isinstance(fact.rank, int):
        return 1
    return sum(symbols.kind(dim) == "nac" for dim in fact.dims)


def _has_nac(fact: Fact, symbols: SymbolTable) -> bool:
    if fact.kind == "tuple":
        return any(_has_nac(f, symbols) for f in fact.fields)
    if fact.kind == "shape":
        return (not isinstance(fact.rank, int) or fact.values is None
                or any(symbols.kind(v) == "nac" for v in fact.values))
    return nac_dims(fact, symbols) > 0


def _all_constant(fact: Fact, symbols: SymbolTable) -> bool:
    if fact.kind == "tuple":
        return all(_all_constant(f, symbols) for f in fact.fields)
    if fact.kind == "tensor":
        return all(symbols.kind(d) == "constant" for d in fact.dims)
    return True


def _summary(result: RDPResult, facts: dict, symbols: SymbolTable, classes: dict) -> Summary:
    tensors = Counter(category(facts[node.var], symbols) for node in result.nodes)
    nac_values = sum(
        (facts[node.var].rank if isinstance(facts[node.var].rank, int) else 1)
        if facts[node.var].values is None else
        sum(symbols.kind(v) == "nac" for v in facts[node.var].values)
        for node in result.nodes if facts[node.var].kind == "shape")
    return Summary(
        tensors={name: tensors.get(name, 0) for name in CATEGORIES},
        nac_dims=sum(nac_dims(facts[node.var], symbols) for node in result.nodes),
        nac_shape_values=nac_values,
        subgraphs=_subgraphs(result, facts, symbols, classes),
    )


def _subgraphs(result: RDPResult, facts: dict, symbols: SymbolTable, classes: dict) -> dict:
    cuts = {node.var for node in result.nodes
            if classes.get(node.var.name) in (EDO.value, ISVDOS.value) and _has_nac(facts[node.var], symbols)}
    parent = {node.var: node.var for node in result.nodes}

    def root(var):
        while parent[var] is not var:
            parent[var] = parent[parent[var]]
            var = parent[var]
        return var

    for node in result.nodes:
        for var in node.inputs:
            if var in parent and var not in cuts:
                parent[root(var)] = root(node.var)
    members: dict = {}
    for node in result.nodes:
        members.setdefault(root(node.var), []).append(node.var)
    kinds = Counter()
    for group in members.values():
        if any(var in cuts for var in group):
            kinds["cut by nac"] += 1
        elif all(_all_constant(facts[var], symbols) for var in group):
            kinds["all constant"] += 1
        else:
            kinds["mixed"] += 1
    return {kind: kinds.get(kind, 0) for kind in SUBGRAPH_KINDS}


def format_report(report: RDPReport, changed_only: bool = False) -> str:
    from .inspection import format_table

    rows = [row for row in report.rows if not changed_only or row["before"] != row["after"]
            or row["class"] != row["class_after"]]
    lines = [format_table(rows, ["binding", "op", "class", "class_after", "before", "after"]) if rows
             else "(no binding changed)", ""]
    for label, summary in (("Relax's inference", report.before), ("after RDP", report.after)):
        tensors = ", ".join(f"{count} {name}" for name, count in summary.tensors.items())
        subgraphs = ", ".join(f"{count} {name}" for name, count in summary.subgraphs.items())
        lines.append(f"{label:18} tensors: {tensors}; nac dims: {summary.nac_dims}; "
                     f"nac shape values: {summary.nac_shape_values}; sub-graphs: {subgraphs}")
    if report.equalities:
        lines.append("equalities: " + "; ".join(report.equalities))
    if not report.converged:
        lines.append("RDP stopped at its visit limit before the fixed point (its facts still hold)")
    return "\n".join(lines)


def zoo_rdp_table(model_names: list[str]) -> str:
    """Markdown: per zoo model, tensors with nac shapes and nac dims, Relax's inference vs RDP."""
    from .testing import zoo

    lines = ["| model | tensors | nac tensors (Relax / RDP) | nac dims (Relax / RDP) "
             "| nac shape values (Relax / RDP) | sub-graphs after RDP (constant / mixed / cut) |",
             "|---|---|---|---|---|---|"]
    for name in model_names:
        report = rdp_report(zoo.get(name).build())
        before, after = report.before, report.after
        subgraphs = " / ".join(str(after.subgraphs[kind]) for kind in SUBGRAPH_KINDS)
        lines.append(f"| {name} | {len(report.rows)} | {before.tensors['nac']} / {after.tensors['nac']} "
                     f"| {before.nac_dims} / {after.nac_dims} "
                     f"| {before.nac_shape_values} / {after.nac_shape_values} | {subgraphs} |")
    return "\n".join(lines) + "\n"


# --- the docs page ---------------------------------------------------------------------------------

def dynamism_classes_markdown() -> str:
    """docs/dynamism-classes.md, from the tables in passes/classify_dynamism.py."""
    lines = [
        "# Dynamism classes (SoD2 §3)",
        "",
        "<!-- generated by `python -m tightfit.dynamism --write-docs docs/dynamism-classes.md`"
        " from passes/classify_dynamism.py; do not edit -->",
        "",
        "Every op gets the most dynamic class that applies while its shape-giving inputs are not",
        "known; constant propagation moves it to the class in the last column once they are (a",
        "constant, or a symbolic expression of the model's input dims — RDP decides).",
        "",
    ]
    for dynamism in (ISDO, ISDOS, ISVDOS, EDO):
        lines.append(f"- **{dynamism.value}**: {dynamism.meaning}")
    lines += ["", f"## ONNX ops ({len(ONNX_OP_DYNAMISM)}: every op tightfit's importer accepts)", "",
              "| ONNX op | class | shape-giving inputs | when they are known | note |",
              "|---|---|---|---|---|"]
    for op, rule in sorted(ONNX_OP_DYNAMISM.items()):
        inputs = ", ".join(str(i) for i in rule.shape_inputs)
        known = rule.when_known.value if rule.when_known else ""
        lines.append(f"| {op} | {rule.base.value} | {inputs} | {known} | {rule.note} |")
    lines += ["", f"## Relax ops ({len(RELAX_OP_DYNAMISM)}: what ClassifyDynamism labels after import)", "",
              "Ops not listed are EDO: nothing is assumed about an op nobody has looked at.", "",
              "| Relax op | class | shape-giving arguments | when they are known | note |",
              "|---|---|---|---|---|"]
    for op, rule in sorted(RELAX_OP_DYNAMISM.items()):
        inputs = ", ".join(str(i) for i in rule.shape_inputs)
        known = rule.when_known.value if rule.when_known else ""
        lines.append(f"| `{op}` | {rule.base.value} | {inputs} | {known} | {rule.note} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tightfit.dynamism", description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write-docs", metavar="PATH", help="write the dynamism class table")
    group.add_argument("--check-docs", metavar="PATH", help="exit 1 if PATH differs from the tables")
    group.add_argument("--zoo-table", metavar="PATH",
                       help="write the nac counts before and after RDP for every zoo model")
    args = parser.parse_args(argv)
    if args.zoo_table:
        from .testing import zoo

        Path(args.zoo_table).write_text(zoo_rdp_table(zoo.names()))
        return 0
    text = dynamism_classes_markdown()
    if args.write_docs:
        Path(args.write_docs).write_text(text)
        return 0
    if Path(args.check_docs).read_text() != text:
        print(f"{args.check_docs} is stale: run python -m tightfit.dynamism --write-docs {args.check_docs}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
