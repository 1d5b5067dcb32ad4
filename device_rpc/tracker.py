"""TVM RPC trackers: addresses, what a tracker has, sessions on a device by key — with clear errors.

TVM's own client waits 60 s before it says a tracker is unreachable, and a request for a key no
device serves waits forever. Here every call checks first and fails in seconds with what to do.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import DeviceError
from ..fresh_process import worker_command

CONNECT_TIMEOUT_S = 3.0
START_TRACKER_HINT = "start one with `python -m tvm.exec.rpc_tracker --host 0.0.0.0 --port 9190`"


@dataclass(frozen=True)
class TrackerAddress:
    host: str
    port: int

    @staticmethod
    def parse(text: str) -> "TrackerAddress":
        host, _, port = text.rpartition(":")
        if not host or not port.isdigit():
            raise DeviceError(f"tracker address {text!r} is not HOST:PORT, e.g. 127.0.0.1:9190")
        return TrackerAddress(host, int(port))

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class KeyQueue:
    """What a tracker knows about one device key."""

    key: str
    total: int  # servers registered under the key
    free: int
    pending: int  # requests waiting for a device


def check_reachable(tracker: TrackerAddress) -> None:
    try:
        with socket.create_connection((tracker.host, tracker.port), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as err:
        raise DeviceError(f"no RPC tracker answers at {tracker} ({err.strerror or err}); "
                          f"check the address, or {START_TRACKER_HINT}") from None


def _session(tracker: TrackerAddress):
    from tvm import rpc

    check_reachable(tracker)
    try:
        return rpc.connect_tracker(tracker.host, tracker.port)
    except RuntimeError as err:
        raise DeviceError(f"{tracker} is not a TVM RPC tracker: {err}") from None


def key_queues(tracker: TrackerAddress) -> list[KeyQueue]:
    """Every key the tracker has, with its device and queue counts."""
    summary = _session(tracker).summary()
    totals: dict[str, int] = {}
    for server in summary["server_info"]:
        key = server["key"].split(":", 1)[-1]  # servers register as 'server:KEY'
        totals[key] = totals.get(key, 0) + 1
    queues = summary["queue_info"]
    return [KeyQueue(key, totals.get(key, 0), queues.get(key, {}).get("free", 0),
                     queues.get(key, {}).get("pending", 0))
            for key in sorted(set(totals) | set(queues))]


def devices_under(tracker: TrackerAddress, key: str) -> int:
    return next((queue.total for queue in key_queues(tracker) if queue.key == key), 0)


def request(tracker: TrackerAddress, key: str, session_timeout_s: float):
    """An RPC session on a device registered under `key`; fails at once if none is."""
    if devices_under(tracker, key) == 0:
        known = ", ".join(queue.key for queue in key_queues(tracker) if queue.total) or "none"
        raise DeviceError(f"the tracker at {tracker} has no device under key {key!r} (keys with devices: "
                          f"{known}); start one, e.g. `tightfit device emulate --key {key} "
                          f"--rpc-tracker {tracker}`")
    try:
        return _session(tracker).request(key, session_timeout=session_timeout_s, max_retry=2)
    except RuntimeError as err:
        raise DeviceError(f"could not open a session on {key!r} via {tracker}: {err}") from None


def wait_for_key(tracker: TrackerAddress, key: str, minimum: int, timeout_s: float,
                 alive: Callable[[], bool] = lambda: True) -> None:
    """Until the tracker lists at least `minimum` devices under `key`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise DeviceError(f"the device server for {key!r} exited before it registered with {tracker}")
        if devices_under(tracker, key) >= minimum:
            return
        time.sleep(0.5)
    raise DeviceError(f"no device registered under {key!r} with {tracker} within {timeout_s:.0f} s")


def free_port(start: int) -> int:
    """The first port from `start` that can be bound on loopback."""
    for port in range(start, start + 1000):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise DeviceError(f"no free port in {start}..{start + 999}")


def start_tracker(port: int, host: str = "127.0.0.1", log: Path | None = None,
                  timeout_s: float = 30.0) -> subprocess.Popen:
    """A TVM RPC tracker in its own process group (it outlives this process); returns once it
    answers. Its output goes to `log` (discarded without one)."""
    output = open(log, "w") if log is not None else subprocess.DEVNULL
    with output if log is not None else contextlib.nullcontext():
        process = subprocess.Popen(worker_command("tvm.exec.rpc_tracker", "--host", host,
                                                  "--port", str(port), "--port-end", str(port + 1)),
                                   stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    address = TrackerAddress(host, port)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise DeviceError(f"the tracker on {address} exited at start (exit {process.returncode})"
                              + (f"; see {log}" if log else ""))
        try:
            check_reachable(address)
            return process
        except DeviceError:
            time.sleep(0.2)
    process.kill()
    raise DeviceError(f"the tracker on {address} did not answer within {timeout_s:.0f} s")


def stop_process_group(pid: int, grace_s: float = 5.0) -> None:
    """SIGTERM to the group `pid` leads (TVM's servers fork workers that hold ports), SIGKILL after
    `grace_s`."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        try:  # reap it if it is our own child
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
