"""The compiled package (`.tfpkg`): a directory holding everything needed to run a model.

Layout (format version 1):
- `manifest.json`: format version, tightfit and TVM versions, target, inputs and outputs as
  declared by the ONNX graph, the weight index (name, dtype, shape, offset, size), the SHA-256 of
  the source model;
- `model.so`: the compiled library (Relax VM executable plus kernels) for the target;
- `weights.bin`: the weights, each blob starting on a page boundary, in the order `main` takes
  them after the model inputs;
- `report.json`: what the compiler did (time per pass, kernel count).

A package is written to a temporary directory beside its destination and renamed into place, so a
failure or a concurrent writer never leaves a half-written package under the final name.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from .errors import PackageError
from .frontend import TensorSpec

FORMAT_VERSION = 1
PAGE_SIZE = mmap.PAGESIZE
MANIFEST = "manifest.json"
LIBRARY = "model.so"
WEIGHTS = "weights.bin"
REPORT = "report.json"


@dataclass
class Package:
    """A compiled model: executable, weights and the facts needed to check inputs."""

    executable: tvm.runtime.Module | relax.VMExecutable
    weights: dict[str, np.ndarray]
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    target: dict
    source_sha256: str
    report: dict = field(default_factory=dict)
    path: Path | None = None

    def session(self, **options) -> "Session":  # noqa: F821
        """A session that runs this package on the host CPU (see `tightfit.session.Session`)."""
        from .session import Session

        return Session(self, **options)

    def save(self, path: str | Path) -> Path:
        """Write the package to `path` (a directory, conventionally `*.tfpkg`) atomically."""
        destination = Path(path)
        destination.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", dir=destination.parent))
        try:
            self._write_contents(staging)
            _replace_directory(staging, destination)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self.path = destination
        return destination

    def _write_contents(self, directory: Path) -> None:
        self.executable.export_library(str(directory / LIBRARY))
        weight_index = _write_weights(directory / WEIGHTS, self.weights)
        manifest = {
            "format_version": FORMAT_VERSION,
            "tightfit_version": _tightfit_version(),
            "tvm_version": tvm.__version__,
            "target": self.target,
            "inputs": [spec.to_json() for spec in self.inputs],
            "outputs": [spec.to_json() for spec in self.outputs],
            "weights": weight_index,
            "source_sha256": self.source_sha256,
        }
        (directory / REPORT).write_text(json.dumps(self.report, indent=2))
        # The manifest is written last: a directory without one was never finished.
        (directory / MANIFEST).write_text(json.dumps(manifest, indent=2))
        _fsync_directory(directory)


def load_package(path: str | Path) -> Package:
    """Open a package written by `Package.save`; raise PackageError when it cannot be used."""
    directory = Path(path)
    manifest_path = directory / MANIFEST
    if not directory.is_dir():
        raise PackageError(f"no package at {directory}; compile one with `tightfit compile`")
    if not manifest_path.is_file():
        raise PackageError(f"{directory} has no {MANIFEST}: it is not a finished tightfit package; "
                           "compile it again")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as err:
        raise PackageError(f"{manifest_path} is corrupt ({err}); compile the package again") from err
    if manifest.get("format_version") != FORMAT_VERSION:
        raise PackageError(f"{directory} has package format {manifest.get('format_version')}, this "
                           f"tightfit reads format {FORMAT_VERSION}; compile the package again")
    if manifest.get("tvm_version") != tvm.__version__:
        raise PackageError(f"{directory} was built with TVM {manifest.get('tvm_version')}, this is "
                           f"TVM {tvm.__version__}; compile the package again")
    for required in (LIBRARY, WEIGHTS):
        if not (directory / required).is_file():
            raise PackageError(f"{directory} lacks {required}; compile the package again")
    weights = _read_weights(directory / WEIGHTS, manifest["weights"])
    report_path = directory / REPORT
    return Package(
        executable=tvm.runtime.load_module(str(directory / LIBRARY)),
        weights=weights,
        inputs=[TensorSpec.from_json(spec) for spec in manifest["inputs"]],
        outputs=[TensorSpec.from_json(spec) for spec in manifest["outputs"]],
        target=manifest["target"],
        source_sha256=manifest["source_sha256"],
        report=json.loads(report_path.read_text()) if report_path.is_file() else {},
        path=directory,
    )


def _write_weights(path: Path, weights: dict[str, np.ndarray]) -> list[dict]:
    index = []
    offset = 0
    with open(path, "wb") as weight_file:
        for name, array in weights.items():
            data = np.asarray(array, order="C")  # ascontiguousarray would make 0-d arrays 1-d
            padding = -offset % PAGE_SIZE
            weight_file.write(b"\0" * padding)
            offset += padding
            weight_file.write(data.tobytes())
            index.append({"name": name, "dtype": str(data.dtype), "shape": list(data.shape),
                          "offset": offset, "size": data.nbytes})
            offset += data.nbytes
        weight_file.flush()
        os.fsync(weight_file.fileno())
    return index


def _read_weights(path: Path, index: list[dict]) -> dict[str, np.ndarray]:
    """Read-only numpy views of the weights in a mapping of the weight file (no copy)."""
    file_size = path.stat().st_size
    mapping = None
    if file_size:
        with open(path, "rb") as weight_file:
            mapping = mmap.mmap(weight_file.fileno(), 0, access=mmap.ACCESS_READ)
    weights = {}
    for entry in index:
        end = entry["offset"] + entry["size"]
        if end > file_size:
            raise PackageError(f"{path} is truncated: weight {entry['name']} ends at byte {end} "
                               f"of {file_size}; compile the package again")
        dtype = np.dtype(entry["dtype"])
        count = entry["size"] // dtype.itemsize
        flat = (np.frombuffer(mapping, dtype=dtype, count=count, offset=entry["offset"])
                if count else np.zeros(0, dtype=dtype))
        weights[entry["name"]] = flat.reshape(entry["shape"])
    return weights


def _replace_directory(staging: Path, destination: Path) -> None:
    """Move a finished package into place; an older package there is removed only afterwards."""
    if destination.exists() and not (destination / MANIFEST).is_file() and any(destination.iterdir()):
        raise PackageError(f"{destination} exists and is not a tightfit package; "
                           "choose another output path")
    retired = None
    if destination.exists():
        retired = destination.with_name(f".{destination.name}.old-{os.getpid()}")
        os.rename(destination, retired)
    os.rename(staging, destination)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)


def _fsync_directory(directory: Path) -> None:
    for entry in directory.iterdir():
        with open(entry, "rb") as handle:
            os.fsync(handle.fileno())
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def sha256_of_model(serialized: bytes) -> str:
    return hashlib.sha256(serialized).hexdigest()


def _tightfit_version() -> str:
    from . import __version__

    return __version__
