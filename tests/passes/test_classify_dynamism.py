"""Every op gets its SoD2 class, the tables cover what the importer accepts and emits, and the
class moves with constant propagation."""

import warnings

import tvm
from tvm.relax.frontend.onnx import onnx_frontend
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tightfit.frontend.converters import CONVERTERS
from tightfit.frontend.importer import _OPS_HANDLED_BY_IMPORTER
from tightfit.passes import ClassifyDynamism, RankDimensionPropagation
from tightfit.passes.classify_dynamism import (ATTR_KEY, ONNX_OP_DYNAMISM, RELAX_OP_DYNAMISM,
                                               iter_bindings, op_key)


def accepted_onnx_ops() -> set[str]:
    return set(onnx_frontend._get_convert_map()) | set(CONVERTERS) | set(_OPS_HANDLED_BY_IMPORTER)


# TVM's converter map also takes these com.microsoft contrib ops (and its own AllClassNMS)
CONTRIB_OPS = {"BiasGelu", "EmbedLayerNormalization", "FastGelu", "MatMulInteger16",
               "SkipLayerNormalization", "AllClassNMS"}


def test_every_onnx_op_the_importer_accepts_has_a_class():
    assert sorted(accepted_onnx_ops() - set(ONNX_OP_DYNAMISM)) == [], "add these ops to ONNX_OP_DYNAMISM"


def test_every_op_in_the_class_table_is_an_onnx_op():
    # an op the importer takes later may be listed ahead of time, but never a misspelled one
    import onnx

    assert sorted(op for op in ONNX_OP_DYNAMISM if not onnx.defs.has(op) and op not in CONTRIB_OPS) == []


def test_every_relax_op_the_passing_node_cases_import_to_has_a_rule():
    # the ONNX backend node cases tightfit passes exercise every converter; whatever Relax op they
    # import to must have a looked-at rule (an op without one would be assumed EDO)
    from pathlib import Path

    from tightfit.conformance import node_cases

    names = (Path(__file__).parents[1] / "data" / "onnx_node_passing.txt").read_text().split()
    cases = node_cases()
    missing: dict[str, str] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            if name not in cases:
                continue
            try:
                mod = import_onnx(cases[name].model).mod
            except Exception:  # not importable in this checkout: the conformance test's business
                continue
            for func in mod.functions.values():
                if not hasattr(func, "body") or not hasattr(func, "params"):
                    continue
                for binding in iter_bindings(func):
                    key = op_key(binding.value)
                    if key not in (None, "call") and key not in RELAX_OP_DYNAMISM:
                        missing.setdefault(key, name)
    assert missing == {}, f"Relax ops without a rule (op: an ONNX case importing to it): {missing}"


@I.ir_module
class ComputedReshape:
    @R.function
    def main(x: R.Tensor(("b", "s"), "float32")):
        r = T.int64()
        with R.dataflow():
            dims = R.shape_to_tensor(R.shape_of(x))
            count = R.prod(dims, keepdims=True)
            shape = R.tensor_to_shape(count)
            named = R.match_cast(shape, R.Shape([r]))
            flat = R.reshape(x, named)
            found = R.nonzero(R.greater(flat, R.const(0.0)))
            ones = R.ones(R.shape([r]), "float32")
            total = R.sum(ones)
            R.output(found, total)
        return found, total


def classes(mod) -> dict:
    return {key: str(value) for key, value in mod["main"].attrs[ATTR_KEY].items()}


def test_classes_follow_the_shape_giving_input():
    before = classes(ClassifyDynamism()(ComputedReshape))
    assert before["dims"] == "ISDO"  # shape_to_tensor(shape_of(x)): the input's shape alone
    assert before["flat"] == "ISVDOS"  # reshape to a shape computed from a tensor
    assert before["ones"] == "ISVDOS"  # ones of a shape bound at run time
    assert before["found"] == "EDO"


def test_rdp_moves_ops_whose_shape_giving_input_it_determines_to_the_less_dynamic_class():
    after = classes(RankDimensionPropagation()(ClassifyDynamism()(ComputedReshape)))
    assert after["flat"] == "ISDOS"  # RDP knows the shape's value: b * s
    assert after["ones"] == "ISDO"  # ones((b * s,)): shape and value from the input's shape
    assert after["found"] == "EDO"  # NonZero stays execution-determined


def test_repeated_binding_names_become_unique_keys_without_changing_the_graph():
    mod = module_with_repeated_names()
    names = [binding.var.name for binding in iter_bindings(mod["main"])]
    assert len(names) > len(set(names))
    classified = ClassifyDynamism()(mod)
    unique = [binding.var.name for binding in iter_bindings(classified["main"])]
    assert len(unique) == len(set(unique)) == len(names)
    assert set(classes(classified)) <= set(unique)


def module_with_repeated_names():
    """x → relu → exp, both bindings named `lv` (TVM's importer often names several so)."""
    from tvm import relax

    n = tvm.tirx.Var("n", "int64")
    ty = relax.TensorType([n, 4], "float32")
    x = relax.Var("x", ty)
    first, second = relax.Var("lv", ty), relax.Var("lv", ty)
    block = relax.BindingBlock([relax.VarBinding(first, relax.op.nn.relu(x)),
                                relax.VarBinding(second, relax.op.exp(first))])
    func = relax.Function([x], relax.SeqExpr([block], second), ty)
    return tvm.IRModule({"main": func})


def test_classes_survive_printing_and_parsing():
    classified = ClassifyDynamism()(ComputedReshape)
    reparsed = tvm.script.from_source(classified.script())
    assert classes(reparsed) == classes(classified)
