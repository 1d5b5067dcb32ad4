"""Fixtures shared by the kernel tests."""

import pytest

from kernel_harness import THRESHOLDS, threshold_database


@pytest.fixture(scope="module", params=list(THRESHOLDS))
def knob_database(request, tmp_path_factory) -> str:
    """A knob database whose parallel threshold sends every run to one side of the work `if`
    (its file name ends in "<side>.json")."""
    path = tmp_path_factory.mktemp("knobs") / f"{request.param}.json"
    return threshold_database(path, THRESHOLDS[request.param])
