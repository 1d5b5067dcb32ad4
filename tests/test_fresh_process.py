"""A worker process runs its module as `python -m` would, with its arguments, and without torch;
so do the workers TVM's popen pool starts for a tuning session; the `tightfit` command imports
torch only where the zoo's PyTorch-exported models need it."""

import os
import subprocess
import sys

import pytest

from tightfit.fresh_process import children_without_torch, worker_command

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


COMMAND_PROBE = """
import sys
from tightfit.cli import main
print("exit", main(sys.argv[1:], torch_only_for_the_zoo=True))
try:
    import torch
    print("torch imported")
except ImportError:
    print("no torch")
"""


@pytest.mark.parametrize("command, torch_found", [
    (["devices", "--json"], "no torch"),
    (["bench", "--zoo", "no_such_model"], "torch imported"),
])
def test_the_command_imports_torch_for_the_zoo_alone(command, torch_found):
    completed = subprocess.run([sys.executable, "-c", COMMAND_PROBE, *command], capture_output=True,
                               text=True, timeout=300)
    assert completed.stdout.splitlines()[-1] == torch_found, completed.stderr


def test_workers_whose_command_is_not_ours_start_without_torch(monkeypatch):
    """MetaSchedule's build and run workers: TVM's popen pool hard-codes their command, and their
    TVM import brought torch in (tvm_ffi imports it where installed)."""
    from tvm.support.popen_pool import PopenPoolExecutor

    monkeypatch.setenv("PYTHONPATH", "/a/path/of/the/users")
    with children_without_torch():
        pool = PopenPoolExecutor(max_workers=1)
        in_worker = pool.submit(lambda: (sorted({"tvm", "torch"} & set(__import__("sys").modules)),
                                         __import__("os").environ["PYTHONPATH"])).result()
        pool.shutdown()
    modules, path = in_worker
    assert modules == ["tvm"]
    assert path.endswith(os.pathsep + "/a/path/of/the/users")
    assert os.environ["PYTHONPATH"] == "/a/path/of/the/users"
