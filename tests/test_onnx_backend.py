"""The ONNX backend node cases tightfit passes keep passing (a regression guard).

tests/data/onnx_node_passing.txt lists the cases that passed in the last full run
(`tightfit conformance --out results.json`, then the names with status "pass"); regenerate it
after a change that makes more cases pass. Each case runs in an isolated worker process.

CI runs CI_CASES_PER_OP of each op's passing cases, spread over its variants (about 500 of the
1,418, 140 s of one core against 600 s for all): `tightfit conformance --cases
tests/data/onnx_node_passing.txt --jobs 2` runs every one of them.
"""

from pathlib import Path

import pytest

from tightfit.conformance import PASS, case_op, node_cases, run_node_tests, spread_per_op

PASSING = Path(__file__).parent / "data" / "onnx_node_passing.txt"
CI_CASES_PER_OP = 4


@pytest.mark.slow
def test_known_passing_node_cases_still_pass():
    names = PASSING.read_text().split()
    assert len(names) > 1400  # the list itself must not shrink unnoticed
    available = node_cases()
    missing = [name for name in names if name not in available]
    assert not missing, f"the installed onnx lacks {missing[:5]}"
    sample = spread_per_op(names, CI_CASES_PER_OP)
    assert {case_op(name) for name in sample} == {case_op(name) for name in names}
    results = run_node_tests("tightfit", names=sample, jobs=2, progress=False)
    regressions = [(r.name, r.reason) for r in results if r.status != PASS]
    assert not regressions, f"{len(regressions)} cases regressed, e.g. {regressions[:5]}"


def test_a_spread_sample_keeps_each_ops_first_and_last_case_and_at_most_its_share():
    names = PASSING.read_text().split()
    sample = spread_per_op(names, 3)
    for op in {case_op(name) for name in names}:
        cases = sorted(name for name in names if case_op(name) == op)
        picked = [name for name in sample if case_op(name) == op]
        assert len(picked) == min(3, len(cases))
        assert picked[0] == cases[0] and picked[-1] == cases[-1]
    assert spread_per_op(names, 1000) == sorted(names)


def test_backend_interface_runs_a_case_through_onnx_api():
    import numpy as np

    from tightfit.conformance import TightfitBackend

    case = node_cases()["test_relu"]
    (inputs, expected), = case.data_sets
    (output,) = TightfitBackend.run_model(case.model, inputs)
    np.testing.assert_allclose(output, expected[0])


def test_a_case_timeout_starts_once_its_worker_is_ready(monkeypatch):
    """A worker's start (imports, loading onnx's cases: 12 s on an idle machine here) is not
    the first case's time: with a 5 s case limit, two tiny cases still pass."""
    from tightfit import conformance

    monkeypatch.setattr(conformance, "CASE_TIMEOUT_S", 5)
    results = run_node_tests("tightfit", names=["test_abs", "test_relu"], jobs=1, progress=False)
    assert [(r.name, r.status) for r in results] == [("test_abs", PASS), ("test_relu", PASS)]


def test_conformance_command_names_a_cases_file_it_cannot_use(tmp_path, capsys):
    from tightfit.cli import main

    assert main(["conformance", "--cases", str(tmp_path / "none.txt")]) == 2
    assert "No such file or directory; pass a file of case names" in capsys.readouterr().err
    cases = tmp_path / "cases.txt"
    cases.write_text("test_relu\ntest_no_such_case\n")
    assert main(["conformance", "--cases", str(cases)]) == 2
    assert "lacks: ['test_no_such_case']" in capsys.readouterr().err
    assert main(["conformance", "--per-op", "0"]) == 2
    assert "--per-op 0: pass 1 or more" in capsys.readouterr().err
