"""A session on a device over RPC: open it through the tracker, upload a library, run, time.

What runs on the device is the uploaded library (linked by the device's cross compiler) and TVM's
own runtime; nothing of tightfit is imported there — a phone has no Python.
"""

from __future__ import annotations

import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..errors import DeviceError
from .devices import export_function
from .tracker import TrackerAddress, request

DEFAULT_SESSION_TIMEOUT_S = 600.0


@dataclass
class RemoteDevice:
    """An open RPC session on one device, and how long it took to get it."""

    rpc_session: object  # tvm.rpc.RPCSession
    tracker: TrackerAddress
    key: str
    open_seconds: float

    @property
    def device(self):
        return self.rpc_session.cpu()

    def load_library(self, library: str | Path):
        """Upload a shared library built for the device and load it there, under a name of its
        own: the device loads a path once, and a later library must not overwrite a loaded one
        (several share one session: a device serves one RPC session at a time)."""
        library = Path(library)
        remote_name = f"{library.stem}-{uuid.uuid4().hex[:12]}{library.suffix}"
        try:
            self.rpc_session.upload(str(library), target=remote_name)
            return self.rpc_session.load_module(remote_name)
        except Exception as err:  # TVM's RPC errors carry the device's message
            raise DeviceError(f"the device under {self.key!r} could not load {library.name}: "
                              f"{str(err).strip().splitlines()[-1]} (was it compiled for this device?)") from None


    def load_built(self, built, cross_compiler: str | None, device_name: str):
        """Link a module built for the device (`tvm.compile`'s result) with its cross compiler
        (None: this machine's), upload it and load it there."""
        fcompile = export_function(cross_compiler, device_name) if cross_compiler else None
        with tempfile.TemporaryDirectory(prefix="tightfit-upload-") as folder:
            library = Path(folder) / "kernels.so"
            built.export_library(str(library), fcompile=fcompile)
            return self.load_library(library)


def connect(tracker: TrackerAddress, key: str, session_timeout_s: float = DEFAULT_SESSION_TIMEOUT_S) -> RemoteDevice:
    """A session on a device under `key`; the server ends it after `session_timeout_s`."""
    started = time.perf_counter()
    rpc_session = request(tracker, key, session_timeout_s)
    return RemoteDevice(rpc_session, tracker, key, time.perf_counter() - started)
