"""The command line of a fresh Python process for one of tightfit's own workers.

The benchmark measures each job in a fresh interpreter (bench.py) and the conformance run
checks ONNX cases in worker processes (conformance.py). Every start imports TVM, and tvm_ffi
imports torch whenever torch is installed (to dodge a symbol clash seen on Windows): here
`import tightfit, onnxruntime` took 9.0-9.3 s and 437 MB of RSS with torch installed, 4.0-4.5 s
and 236 MB without. No worker uses torch (they load ONNX files), so a worker's interpreter marks
torch as absent before anything imports it; a user's own process is left as it is.
"""

from __future__ import annotations

import sys

_WITHOUT_TORCH = ("import runpy, sys; sys.modules['torch'] = None; del sys.argv[0]; "
                  "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")


def worker_command(module: str, *args: str) -> list[str]:
    """`python -m module args...`, in an interpreter where `import torch` fails."""
    return [sys.executable, "-c", _WITHOUT_TORCH, module, *args]
