"""tightfit: an ONNX compiler on Apache TVM for phones and edge boards.

    import tightfit
    pkg = tightfit.compile("model.onnx", target="host")
    pkg.save("model.tfpkg"); pkg = tightfit.load("model.tfpkg")
    outputs = pkg.session().run({"input": x})

The public names below import TVM when first used, not with the package: the `tightfit` command
decides first whether its process may import torch, which TVM imports whenever it is installed
(cli.entry_point; 4-5 s of every command's start).
"""

import os as _os

# TVM's thread pool reads this once, when it first starts, and defaults to one thread here.
_os.environ.setdefault("TVM_NUM_THREADS", str(len(_os.sched_getaffinity(0))))

__version__ = "0.1.0"

from . import errors  # noqa: E402

_PUBLIC = {"compile": "api", "load": "api", "Package": "package", "PipelineOptions": "pipeline"}


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'tightfit' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f".{_PUBLIC[name]}", __name__), name)


__all__ = ["Package", "PipelineOptions", "compile", "errors", "load", "__version__"]
