"""The compiled package (`.tfpkg`): a directory holding everything needed to run a model.

Layout (format version 3):
- `manifest.json`: format version, tightfit and TVM versions, target, the compile options
  (to rebuild), inputs and outputs as the ONNX graph declares them, which outputs each run
  allocates anew (`fresh_outputs`), and the source model (path, size, modification time,
  SHA-256) so that a changed source is noticed;
- `model.so`: the compiled library (Relax VM executable plus kernels) for the target;
- `weights.tfw`: the pre-transformed weights (`tightfit.weight_file`), mapped at load;
- `report.json`: what the compiler did (time per pass, kernel count, weight file statistics).

A package is written to a temporary directory beside its destination and swapped into place
atomically, under a lock that serializes concurrent writers, so readers see the old package or
the new one, never a mix or a half-written one.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import tvm
from tvm import relax

from .errors import CorruptPackageError, PackageError, StalePackageError
from .frontend import TensorSpec
from .weight_file import WeightFile, WeightTensor, write_weight_file

# 4: kernels take tensors at any element-aligned address (kernel_lowering.py), and sessions
# pass them so; a format-3 library's kernels assume 64-byte alignment and would crash
FORMAT_VERSION = 4
MANIFEST = "manifest.json"
LIBRARY = "model.so"
WEIGHTS = "weights.tfw"
REPORT = "report.json"


@dataclass(frozen=True)
class SourceModel:
    """Where a package came from, to rebuild it and to notice when the source has changed."""

    path: str | None
    sha256: str
    size: int | None = None
    mtime_ns: int | None = None

    @staticmethod
    def of_file(path: str | Path) -> SourceModel:
        stat = Path(path).stat()
        return SourceModel(str(Path(path).resolve()), _file_sha256(path), stat.st_size, stat.st_mtime_ns)

    @staticmethod
    def of_proto(proto) -> SourceModel:
        return SourceModel(None, hashlib.sha256(proto.SerializeToString()).hexdigest())

    def has_changed(self, path: str | Path) -> bool:
        """Whether the file at `path` differs from this source (size and mtime first, then hash)."""
        stat = Path(path).stat()
        if stat.st_size == self.size and stat.st_mtime_ns == self.mtime_ns:
            return False
        return _file_sha256(path) != self.sha256


def _file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        for chunk in iter(lambda: source.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class Package:
    """A compiled model: executable, weights and the facts needed to check inputs and rebuild."""

    executable: tvm.runtime.Module | relax.VMExecutable | None  # None: a device's library, not loaded here
    weights: list[WeightTensor]
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    target: dict
    source: SourceModel
    compile_options: dict = field(default_factory=dict)
    report: dict = field(default_factory=dict)
    path: Path | None = None
    # per output: allocated anew by every run, so a session hands it out without a copy
    fresh_outputs: list[bool] = field(default_factory=list)

    def session(self, **options) -> "Session":  # noqa: F821
        """A session that runs this package on the host CPU (see `tightfit.session.Session`)."""
        from .session import Session

        return Session(self, **options)

    def remote_session(self, tracker: str, key: str, session_timeout_s: float = 600.0) -> "Session":  # noqa: F821
        """A session that runs this package on a device under `key` at the RPC `tracker` (HOST:PORT):
        the library is uploaded, the weights copied to the device once."""
        from .device_rpc import remote
        from .device_rpc.tracker import TrackerAddress

        return self.session_on(remote.connect(TrackerAddress.parse(tracker), key, session_timeout_s))

    def session_on(self, device) -> "Session":  # noqa: F821
        """A session on an open connection to a device (`device_rpc.remote.connect`), which
        several packages may share: a device serves one RPC session at a time, so a second
        connection would wait for the first to close."""
        from .session import Session

        with tempfile.TemporaryDirectory(prefix="tightfit-upload-") as folder:
            module = device.load_library(self.export_library(Path(folder) / LIBRARY))
        return Session(self, device=device.device, executable=module, remote=device)

    def save(self, path: str | Path) -> Path:
        """Write the package to `path` (a directory, conventionally `*.tfpkg`) atomically."""
        destination = Path(path)
        destination.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", dir=destination.parent))
        try:
            self._write_contents(staging)
            _swap_into_place(staging, destination)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self.path = destination
        return destination

    @property
    def runs_on_host(self) -> bool:
        """False for a package cross-compiled for a device (run it there over RPC)."""
        return not self.target.get("cross_compiler")

    def export_library(self, path: str | Path) -> Path:
        """The compiled library as one shared object, linked for the target's machine."""
        if self.executable is None:  # loaded from a device package: the file is already linked
            shutil.copyfile(self.path / LIBRARY, path)
            return Path(path)
        fcompile = None
        if not self.runs_on_host:
            from .device_rpc.devices import export_function

            fcompile = export_function(self.target["cross_compiler"], self.target["name"])
        self.executable.export_library(str(path), fcompile=fcompile)
        return Path(path)

    def _write_contents(self, directory: Path) -> None:
        self.export_library(directory / LIBRARY)
        stats = write_weight_file(directory / WEIGHTS, self.weights, self.provenance())
        self.report["weight_file"] = asdict(stats)
        manifest = {
            "format_version": FORMAT_VERSION,
            **self.provenance(),
            "compile_options": self.compile_options,
            "inputs": [spec.to_json() for spec in self.inputs],
            "outputs": [spec.to_json() for spec in self.outputs],
            "fresh_outputs": self.fresh_outputs,
            "source": asdict(self.source),
        }
        (directory / REPORT).write_text(json.dumps(self.report, indent=2))
        # The manifest is written last: a directory without one was never finished.
        (directory / MANIFEST).write_text(json.dumps(manifest, indent=2))
        _fsync_directory(directory)

    def provenance(self) -> dict:
        """What produced this package; a package or weight file is stale when any of it differs."""
        return {"tightfit_version": _tightfit_version(), "tvm_version": tvm.__version__,
                "target": self.target}


def read_manifest(path: str | Path) -> dict:
    """The manifest of the package at `path`; PackageError if there is no finished package."""
    directory = Path(path)
    manifest_path = directory / MANIFEST
    if not directory.is_dir():
        raise PackageError(f"no package at {directory}; compile one with `tightfit compile`")
    if not manifest_path.is_file():
        raise CorruptPackageError(f"{directory} has no {MANIFEST}: it is not a finished tightfit "
                                  "package; compile it again")
    try:
        return json.loads(manifest_path.read_text())
    except json.JSONDecodeError as err:
        raise CorruptPackageError(f"{manifest_path} is corrupt ({err}); compile the package again") from err


def load_package(path: str | Path, verify: bool = False, source: str | Path | None = None) -> Package:
    """Open a package written by `Package.save`.

    Raises StalePackageError when it was built by another tightfit/TVM version or package format,
    or when `source` (default: the recorded source path, if that file exists) has changed since;
    CorruptPackageError when a file is missing or truncated, or (with `verify`) a weight blob fails
    its hash.
    """
    directory = Path(path)
    manifest = read_manifest(directory)
    expected = {"format_version": FORMAT_VERSION, "tightfit_version": _tightfit_version(),
                "tvm_version": tvm.__version__}
    stale = [f"{key} is {manifest.get(key)!r}, this is {value!r}"
             for key, value in expected.items() if manifest.get(key) != value]
    if stale:
        raise StalePackageError(f"{directory} is stale: {'; '.join(stale)}")
    recorded = SourceModel(**manifest["source"])
    source_path = source or recorded.path
    if source_path is not None and Path(source_path).is_file() and recorded.has_changed(source_path):
        raise StalePackageError(f"{directory} is stale: its source {source_path} has changed")
    if not (directory / LIBRARY).is_file():
        raise CorruptPackageError(f"{directory} lacks {LIBRARY}; compile the package again")
    weight_file = WeightFile(directory / WEIGHTS, verify=verify,
                             expect={"tightfit_version": manifest["tightfit_version"],
                                     "tvm_version": manifest["tvm_version"],
                                     "target": manifest["target"]})
    keys = _keys_by_tensor(weight_file.header)
    report_path = directory / REPORT
    return Package(
        # A device's library cannot be loaded here: it is uploaded from the package at run time.
        executable=(tvm.runtime.load_module(str(directory / LIBRARY))
                    if not manifest["target"].get("cross_compiler") else None),
        weights=[WeightTensor(name, value, keys[name]) for name, value in weight_file.arrays().items()],
        inputs=[TensorSpec.from_json(spec) for spec in manifest["inputs"]],
        outputs=[TensorSpec.from_json(spec) for spec in manifest["outputs"]],
        target=manifest["target"],
        source=recorded,
        compile_options=manifest["compile_options"],
        report=json.loads(report_path.read_text()) if report_path.is_file() else {},
        path=directory,
        fresh_outputs=manifest["fresh_outputs"],
    )


def _keys_by_tensor(header: dict) -> dict[str, str]:
    """A blob lists the keys of the tensors stored in it in tensor order; undo that."""
    keys = {}
    taken: dict[int, int] = {}
    for entry in header["tensors"]:
        position = taken.get(entry["blob"], 0)
        taken[entry["blob"]] = position + 1
        keys[entry["name"]] = header["blobs"][entry["blob"]]["keys"][position]
    return keys


def _swap_into_place(staging: Path, destination: Path) -> None:
    """Put a finished package at `destination`; an old one there ends up at `staging`."""
    lock_path = destination.with_name(f".{destination.name}.lock")
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if destination.exists() and not (destination / MANIFEST).is_file() and any(destination.iterdir()):
            raise PackageError(f"{destination} exists and is not a tightfit package; "
                               "choose another output path")
        if destination.exists():
            _exchange(staging, destination)
        else:
            os.rename(staging, destination)


def _exchange(first: Path, second: Path) -> None:
    """Swap two directories in one step (Linux renameat2 RENAME_EXCHANGE)."""
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, rename_exchange = -100, 2
    if libc.renameat2(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), rename_exchange):
        error = ctypes.get_errno()
        raise OSError(error, f"cannot swap {first} and {second}: {os.strerror(error)}")


def _fsync_directory(directory: Path) -> None:
    for entry in directory.iterdir():
        with open(entry, "rb") as handle:
            os.fsync(handle.fileno())
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _tightfit_version() -> str:
    from . import __version__

    return __version__
