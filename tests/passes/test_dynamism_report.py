"""The inspection layer over ClassifyDynamism and RDP: the report, its summary, the CLI flag and
the generated docs page."""

import json

import pytest

import rdp_models
from tightfit.cli import main as cli
from tightfit.dynamism import DOCS_PAGE, dynamism_classes_markdown, main as dynamism_main, rdp_report
from tightfit.passes.classify_dynamism import ONNX_OP_DYNAMISM
from tightfit.testing import zoo

DATA_DEPENDENT = {
    "nonzero_gather": lambda: zoo.get("nonzero_gather").build(),
    "nonzero_rows_tied": rdp_models.nonzero_rows_tied,
    "if_different_shapes": rdp_models.if_different_shapes,
    "reshape_to_computed_shape": rdp_models.reshape_to_computed_shape,
}


def test_committed_docs_page_is_what_the_tables_generate():
    assert DOCS_PAGE.read_text() == dynamism_classes_markdown(), (
        "docs/dynamism-classes.md is stale: run python -m tightfit.dynamism --write-docs "
        "docs/dynamism-classes.md")
    assert dynamism_main(["--check-docs", str(DOCS_PAGE)]) == 0


def test_docs_page_lists_every_onnx_op_with_its_condition():
    page = dynamism_classes_markdown()
    for op, rule in ONNX_OP_DYNAMISM.items():
        line = next(line for line in page.splitlines() if line.startswith(f"| {op} |"))
        assert f"| {rule.base.value} |" in line
    assert "| Reshape | ISVDOS | 1 | ISDOS |" in page
    assert "| Range | ISVDOS | 0, 1, 2 | ISDO |" in page


def test_check_docs_fails_on_a_stale_page(tmp_path, capsys):
    stale = tmp_path / "dynamism-classes.md"
    stale.write_text(dynamism_classes_markdown().replace("| NonZero | EDO", "| NonZero | ISDOS"))
    assert dynamism_main(["--check-docs", str(stale)]) == 1
    assert "stale" in capsys.readouterr().err


@pytest.mark.parametrize("name", DATA_DEPENDENT)
def test_rdp_leaves_fewer_nac_dims_than_relax_on_data_dependent_models(name):
    report = rdp_report(DATA_DEPENDENT[name]())
    assert report.after.nac_dims < report.before.nac_dims
    assert report.converged


def test_report_rows_cover_every_binding_and_the_summary_counts_every_tensor():
    report = rdp_report(rdp_models.nonzero_rows_tied())
    by_binding = {row["binding"]: row for row in report.rows}
    assert by_binding["lv_1"]["op"] == "nonzero"
    assert by_binding["lv_1"]["class"] == "EDO"
    assert by_binding["lv_1"]["before"] == "(nac, nac)"
    assert by_binding["lv_1"]["after"] == "(1, rows)"
    tensor_rows = [row for row in report.rows if row["before"].startswith("(")]
    assert sum(report.before.tensors.values()) == sum(report.after.tensors.values()) == len(tensor_rows)
    # before: the NonZero cuts the graph; after RDP has tied its count to `rows`, nothing does
    assert report.before.subgraphs["cut by nac"] == 1
    assert report.after.subgraphs["cut by nac"] == 0
    assert report.equalities == ["nonzero_numbers == rows"]


def test_static_model_is_one_all_constant_subgraph():
    report = rdp_report(static_mlp())
    assert report.after.tensors["nac"] == report.after.tensors["symbolic"] == 0
    assert report.after.subgraphs == {"all constant": 1, "mixed": 0, "cut by nac": 0}


def static_mlp():
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    weights = numpy_helper.from_array(np.ones((8, 4), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        "static_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [weights])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_inspect_rdp_prints_classes_values_and_the_summary(tmp_path, capsys):
    import onnx

    path = tmp_path / "tied.onnx"
    onnx.save(rdp_models.nonzero_rows_tied(), str(path))
    assert cli(["inspect", str(path), "--rdp"]) == 0
    text = capsys.readouterr().out
    assert "dynamism classes and RDP" in text
    assert "(1, rows)" in text and "after RDP" in text
    assert cli(["inspect", str(path), "--rdp", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["rdp"]["after"]["nac_dims"] == 0
    assert data["rdp"]["before"]["nac_dims"] > 0
