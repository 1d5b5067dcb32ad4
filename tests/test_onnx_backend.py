"""The ONNX backend node cases tightfit passes keep passing (a regression guard).

tests/data/onnx_node_passing.txt lists the cases that passed in the last full run
(`tightfit conformance --out results.json`, then the names with status "pass"); regenerate it
after a change that makes more cases pass. Each case runs in an isolated worker process.
"""

from pathlib import Path

import pytest

from tightfit.conformance import PASS, node_cases, run_node_tests

PASSING = Path(__file__).parent / "data" / "onnx_node_passing.txt"


@pytest.mark.slow
def test_known_passing_node_cases_still_pass():
    names = PASSING.read_text().split()
    assert len(names) > 700  # the list itself must not shrink unnoticed
    available = node_cases()
    missing = [name for name in names if name not in available]
    assert not missing, f"the installed onnx lacks {missing[:5]}"
    results = run_node_tests("tightfit", names=names, jobs=2, progress=False)
    regressions = [(r.name, r.reason) for r in results if r.status != PASS]
    assert not regressions, f"{len(regressions)} cases regressed, e.g. {regressions[:5]}"


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
