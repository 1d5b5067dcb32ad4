"""The folder where tightfit keeps what one process computed for others: onnx's node test cases
(conformance.py), the zoo's models exported from PyTorch (testing/zoo.py) and the emulated Arm64
device (device_rpc/emulated.py).

It is $TIGHTFIT_CACHE, else $XDG_CACHE_HOME/tightfit, else ~/.cache/tightfit. Each file there is
named by everything its contents depend on, so a stale one is never read, only left behind.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO


def cache_dir() -> Path:
    if "TIGHTFIT_CACHE" in os.environ:
        return Path(os.environ["TIGHTFIT_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tightfit"


def write_whole(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """`write` the file at `path` into a temporary file renamed to `path`, so that a process
    reading it never sees half of it. Where the folder cannot be written, nothing is kept: the
    next process computes it again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as partial:
            try:
                write(partial)
            except BaseException:
                os.unlink(partial.name)
                raise
        os.replace(partial.name, path)
    except OSError:
        pass
