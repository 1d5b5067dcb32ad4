"""The command line of a fresh Python process for one of tightfit's own workers.

The benchmark measures each job in a fresh interpreter (bench.py) and the conformance run
checks ONNX cases in worker processes (conformance.py). Every start imports TVM, and tvm_ffi
imports torch whenever torch is installed (to dodge a symbol clash seen on Windows): here
`import tightfit, onnxruntime` took 9.0-9.3 s and 437 MB of RSS with torch installed, 4.0-4.5 s
and 236 MB without. No worker uses torch (they load ONNX files), so a worker's interpreter marks
torch as absent before anything imports it, and so does the `tightfit` command where it needs
no torch (cli.entry_point); a user's own process is left as it is.

Workers whose command line is not ours (MetaSchedule's build and run workers: TVM's popen pool
starts `python -m tvm.exec.popen_worker`) are started under `children_without_torch`, which puts
a `torch` module that fails to import first on their PYTHONPATH.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

WITHOUT_TORCH_PATH = str(Path(__file__).parent / "without_torch")  # its torch.py fails to import
_WITHOUT_TORCH = ("import runpy, sys; from tightfit.fresh_process import forbid_torch; forbid_torch(); "
                  "del sys.argv[0]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")


def forbid_torch() -> None:
    """Make `import torch` fail in this process from now on (tvm_ffi then goes without it);
    a process that imported torch already keeps it."""
    sys.modules.setdefault("torch", None)


@contextlib.contextmanager
def children_without_torch():
    """Processes started inside this context, by any code, fail to import torch."""
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([WITHOUT_TORCH_PATH, *filter(None, [previous])])
    try:
        yield
    finally:
        if previous is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = previous


def worker_command(module: str, *args: str) -> list[str]:
    """`python -m module args...`, in an interpreter where `import torch` fails."""
    return [sys.executable, "-c", _WITHOUT_TORCH, module, *args]
