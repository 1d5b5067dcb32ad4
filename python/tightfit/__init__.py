"""tightfit: an ONNX compiler on Apache TVM for phones and edge boards.

    import tightfit
    pkg = tightfit.compile("model.onnx", target="host")
    pkg.save("model.tfpkg"); pkg = tightfit.load("model.tfpkg")
    outputs = pkg.session().run({"input": x})
"""

import os as _os

# TVM's thread pool reads this once, when it first starts, and defaults to one thread here.
_os.environ.setdefault("TVM_NUM_THREADS", str(len(_os.sched_getaffinity(0))))

__version__ = "0.1.0"

from . import errors  # noqa: E402
from .api import compile, load  # noqa: E402,A004
from .package import Package  # noqa: E402
from .pipeline import PipelineOptions  # noqa: E402

__all__ = ["Package", "PipelineOptions", "compile", "errors", "load", "__version__"]
