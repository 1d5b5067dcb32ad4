"""An emulated Arm64 device: TVM's aarch64 runtime and RPC server run by qemu-user.

No phone is attached to the machines tightfit is developed on, so tests and demos use this one.
It is a real TVM RPC device: the aarch64 build of TVM's runtime (the PyPI wheel, unpacked without
the compiler library) serving RPC under qemu-user, registered with a tracker under a key. Nothing
of tightfit runs on it: what runs there travels inside the uploaded library or is TVM's runtime.

Setup is done once and cached (`cache_dir()`, default ~/.cache/tightfit/emulated-arm64):
1. Debian packages qemu-user-static and g++-aarch64-linux-gnu (the cross compiler that exports
   libraries for the device), installed with apt-get when missing (root needed once).
2. An aarch64 CPython 3.11 sysroot: the arm64 .deb files are downloaded and unpacked into a
   folder (`dpkg -x`), never installed into the host.
3. The aarch64 wheels of apache-tvm (runtime part only), apache-tvm-ffi and what TVM's RPC server
   imports, unpacked into a folder put on the device's PYTHONPATH.
4. sitecustomize.py there points `sys.executable` at a wrapper that runs the sysroot's python
   through qemu, so the server's worker processes run under qemu too (no binfmt_misc needed).

Each started server runs in its own process group (its forked child keeps the port otherwise), and
is recorded in the cache's state folder by key, so `stop(key)` ends exactly what `start` began.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import user_cache
from ..errors import DeviceError
from .tracker import (TrackerAddress, check_reachable, devices_under, free_port, start_tracker,
                      stop_process_group, wait_for_key)

TVM_VERSION = "0.27.0.post1"
TVM_FFI_VERSION = "0.1.14.post1"  # 0.1.15.post2 segfaults in tvm.ir.save_json (MetaSchedule)
HOST_PACKAGES = {"qemu-aarch64-static": "qemu-user-static", "aarch64-linux-gnu-g++": "g++-aarch64-linux-gnu"}
SYSROOT_PACKAGES = [
    "python3.11-minimal", "libpython3.11-minimal", "libpython3.11-stdlib", "libc6", "libstdc++6",
    "libgcc-s1", "libgomp1", "libexpat1", "zlib1g", "libffi8", "libssl3", "libbz2-1.0", "liblzma5",
    "libsqlite3-0", "libuuid1", "libncursesw6", "libtinfo6", "libreadline8", "libdb5.3", "libgdbm6",
    "libnsl2", "libtirpc3", "libcrypt1",
]
DEVICE_WHEELS = [f"apache-tvm=={TVM_VERSION}", f"apache-tvm-ffi=={TVM_FFI_VERSION}", "numpy", "ml_dtypes",
                 "typing_extensions", "psutil", "cloudpickle", "tornado"]
# The device serves compiled code only: TVM's compiler library (240 MB) and its 3rdparty tree
# stay out of the unpacked wheel.
_LEFT_OUT_OF_DEVICE = ("tvm/lib/libtvm_compiler.so", "tvm/3rdparty/")
SERVER_START_TIMEOUT_S = 180.0
# The device's server: TVM's RPC listen loop in the launched process. `python -m
# tvm.exec.rpc_server` runs the loop in a worker process it starts, which imports TVM a second
# time under qemu: a device took 51 s to register here, 25 s of it each import.
SERVER_LOOP = """
import logging, sys
from tvm.rpc.server import PopenRPCServerState
logging.basicConfig(level=logging.INFO)
host, port, key, tracker_host, tracker_port, library = sys.argv[1:]
server = PopenRPCServerState(host, int(port), int(port) + 1, tracker_addr=(tracker_host, int(tracker_port)),
                             key=key, load_library=library)
server.thread.join()
"""


def cache_dir() -> Path:
    return user_cache.cache_dir() / "emulated-arm64"


@dataclass
class EmulatedServer:
    """One running device server, as recorded in the state folder."""

    key: str
    pid: int  # also its process group id
    port: int
    tracker: str
    log: str
    started_s: float  # seconds from launch until the tracker listed the key (0 until then)

    def alive(self) -> bool:
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


# --- setup ---------------------------------------------------------------------------------------

def setup(progress=print) -> Path:
    """Everything the device needs, built once into cache_dir(); returns that folder."""
    root = cache_dir()
    ready = root / "ready.json"
    if ready.exists() and json.loads(ready.read_text()).get("tvm") == TVM_VERSION:
        return root
    _ensure_host_packages(progress)
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "sysroot" / "usr" / "bin" / "python3.11").exists():
        progress("emulated-arm64: downloading the aarch64 Python sysroot (Debian arm64 packages)")
        _build_sysroot(root / "sysroot")
    if not (root / "site" / "tvm").exists():
        progress("emulated-arm64: downloading the aarch64 wheels of TVM's runtime")
        _build_site(root / "site", root)
    ready.write_text(json.dumps({"tvm": TVM_VERSION, "tvm_ffi": TVM_FFI_VERSION}))
    return root


def _ensure_host_packages(progress) -> None:
    missing = [package for tool, package in HOST_PACKAGES.items() if shutil.which(tool) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        raise DeviceError(f"the emulated device needs the Debian packages {' '.join(missing)}: run "
                          f"`sudo apt-get install -y {' '.join(missing)}` once, then try again")
    progress(f"emulated-arm64: apt-get install {' '.join(missing)}")
    _apt(["update"])
    _apt(["install", "-y", "--no-install-recommends", *missing])


def _apt(args: list[str], cwd: Path | None = None) -> None:
    result = subprocess.run(["apt-get", "-q", *args], cwd=cwd, capture_output=True, text=True,
                            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    if result.returncode != 0:
        raise DeviceError(f"apt-get {' '.join(args[:2])} failed (exit {result.returncode}):\n"
                          f"{result.stderr.strip()[-2000:]}")


def _build_sysroot(sysroot: Path) -> None:
    architectures = subprocess.run(["dpkg", "--print-foreign-architectures"], capture_output=True,
                                   text=True).stdout.split()
    if "arm64" not in architectures:
        if os.geteuid() != 0:
            raise DeviceError("the emulated device's sysroot needs Debian's arm64 package lists: run "
                              "`sudo dpkg --add-architecture arm64 && sudo apt-get update` once")
        subprocess.run(["dpkg", "--add-architecture", "arm64"], check=True)
        _apt(["update"])
    with tempfile.TemporaryDirectory(prefix="tightfit-arm64-debs-") as downloads:
        _apt(["download", *(f"{package}:arm64" for package in SYSROOT_PACKAGES)], cwd=Path(downloads))
        staging = sysroot.with_name(sysroot.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        for deb in sorted(Path(downloads).glob("*.deb")):
            subprocess.run(["dpkg", "-x", str(deb), str(staging)], check=True)
    staging.rename(sysroot)


def _build_site(site: Path, root: Path) -> None:
    wheels = root / "wheels"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--platform", "manylinux_2_28_aarch64", "--python-version", "3.11", "-d", str(wheels),
         *DEVICE_WHEELS], capture_output=True, text=True)
    if result.returncode != 0:
        raise DeviceError(f"pip could not download the aarch64 wheels:\n{result.stderr.strip()[-2000:]}")
    staging = site.with_name(site.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(staging, [name for name in archive.namelist()
                                         if not name.startswith(_LEFT_OUT_OF_DEVICE)])
    staging.rename(site)
    _write_launcher(site, root / "sysroot")
    shutil.rmtree(wheels)


def _write_launcher(site: Path, sysroot: Path) -> None:
    """python-aarch64 runs the sysroot's python under qemu; sitecustomize makes it sys.executable."""
    launcher = site / "python-aarch64"
    launcher.write_text(f'#!/bin/sh\nexec qemu-aarch64-static -L "{sysroot}" "{sysroot}/usr/bin/python3.11" "$@"\n')
    launcher.chmod(0o755)
    (site / "sitecustomize.py").write_text(
        "# Written by tightfit's emulated device: child processes must run under qemu too.\n"
        f"import sys\nsys.executable = {str(launcher)!r}\n")


# --- servers -------------------------------------------------------------------------------------

def _state_dir() -> Path:
    path = cache_dir() / "servers"
    path.mkdir(parents=True, exist_ok=True)
    return path


def running(key: str | None = None) -> list[EmulatedServer]:
    """The servers started here that are still alive (records of dead ones are dropped)."""
    servers = []
    for record in sorted(_state_dir().glob("*.json")):
        server = EmulatedServer(**json.loads(record.read_text()))
        if not server.alive():
            record.unlink(missing_ok=True)
        elif key is None or server.key == key:
            servers.append(server)
    return servers


def start(key: str, tracker: TrackerAddress, threads: int = 2, progress=print) -> EmulatedServer:
    """Start one device server registered under `key`; a second call adds a second device."""
    root = setup(progress)
    site, sysroot = root / "site", root / "sysroot"
    port = free_port(9090)
    log = _state_dir() / f"{key}-{port}.log"
    env = {**os.environ, "PYTHONPATH": str(site), "TVM_NUM_THREADS": str(threads),
           "TVM_USE_RUNTIME_LIB": "1", "QEMU_LD_PREFIX": str(sysroot)}
    env.pop("PYTHONHOME", None)
    # random_fill_for_measure (MetaSchedule's runner) lives in the runtime's extra library
    command = [str(site / "python-aarch64"), "-c", SERVER_LOOP, "127.0.0.1", str(port), key,
               tracker.host, str(tracker.port), str(site / "tvm" / "lib" / "libtvm_runtime_extra.so")]
    devices_before = devices_under(tracker, key)
    launched = time.monotonic()
    with open(log, "w") as log_file:
        process = subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    progress(f"emulated-arm64: server pid {process.pid} on port {port}, registering as {key!r} with {tracker}")
    # recorded at once, so that `stop(key)` finds it even if this process dies while it registers
    record = _state_dir() / f"{key}-{port}.json"
    server = EmulatedServer(key, process.pid, port, str(tracker), str(log), started_s=0.0)
    record.write_text(json.dumps(asdict(server)))
    try:
        wait_for_key(tracker, key, minimum=devices_before + 1, timeout_s=SERVER_START_TIMEOUT_S,
                     alive=lambda: process.poll() is None)
    except DeviceError as err:
        stop_process_group(process.pid)
        record.unlink(missing_ok=True)
        raise DeviceError(f"{err}; the server's log ({log}) ends with:\n{_tail(log)}") from None
    server.started_s = time.monotonic() - launched
    record.write_text(json.dumps(asdict(server)))
    return server


def stop(key: str) -> list[EmulatedServer]:
    """End every server started here under `key`, and the tracker `ensure_tracker` started once
    no server started here is left; returns the servers."""
    servers = running(key)
    for server in servers:
        stop_process_group(server.pid)
        (_state_dir() / f"{server.key}-{server.port}.json").unlink(missing_ok=True)
    tracker_record = _state_dir() / "tracker.pid"
    if not running() and tracker_record.exists():
        stop_process_group(int(tracker_record.read_text()))
        tracker_record.unlink()
    return servers


def ensure_tracker(tracker: TrackerAddress, progress=print) -> bool:
    """Start a tracker at a loopback address where none answers; True if one was started."""
    try:
        check_reachable(tracker)
        return False
    except DeviceError:
        if tracker.host not in ("127.0.0.1", "localhost"):
            raise
    progress(f"emulated-arm64: no tracker answers at {tracker}; starting one there")
    process = start_tracker(tracker.port, tracker.host, log=_state_dir() / "tracker.log")
    (_state_dir() / "tracker.pid").write_text(str(process.pid))
    return True


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
