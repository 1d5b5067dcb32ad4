"""A worker process runs its module as `python -m` would, with its arguments, and without torch."""

import os
import subprocess

from tightfit.fresh_process import worker_command

PROBE = """
import sys
try:
    import torch
    torch_found = "torch imported"
except ImportError:
    torch_found = "no torch"
print(__name__, sys.argv[1:], torch_found)
"""


def test_a_worker_runs_its_module_as_main_with_its_arguments_and_cannot_import_torch(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    completed = subprocess.run(worker_command("probe", "a", "b c"), cwd=tmp_path, capture_output=True,
                               text=True, env={**os.environ, "PYTHONPATH": str(tmp_path)}, check=True)
    assert completed.stdout.strip() == "__main__ ['a', 'b c'] no torch"
