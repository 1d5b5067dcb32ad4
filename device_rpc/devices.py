"""Device descriptions: what a phone or board is, for the compiler and for the people tuning on it.

A description is a JSON file (shipped presets in device_rpc/presets/, or your own file):
- `name`, `description`;
- `target`: the TVM target dict (triple, CPU, features such as +neon/+dotprod/+i8mm/+sve, and
  `num-cores`: the threads the kernels are built to use — the big cores, not all of them);
- `cross_compiler`: the C++ compiler that links the exported library for the device
  (`aarch64-linux-gnu-g++` for Arm64 Linux; for Android, the NDK's
  `$ANDROID_NDK/toolchains/llvm/prebuilt/linux-x86_64/bin/aarch64-linux-android<API>-clang++`,
  environment variables expanded when it is used);
- `clusters`: core clusters (name, core, count, max_mhz) — big.LITTLE layouts;
- `memory_mb`: the device's memory, where known.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import TargetError

PRESETS_DIR = Path(__file__).resolve().parent / "presets"


@dataclass(frozen=True)
class Cluster:
    name: str
    core: str
    count: int
    max_mhz: int | None = None


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    description: str
    target: dict
    cross_compiler: str | None
    clusters: list[Cluster] = field(default_factory=list)
    memory_mb: int | None = None

    @staticmethod
    def from_json(data: dict, origin: str) -> "DeviceSpec":
        missing = {"name", "target"} - set(data)
        if missing:
            raise TargetError(f"device description {origin} lacks {sorted(missing)}")
        return DeviceSpec(data["name"], data.get("description", ""), data["target"],
                          data.get("cross_compiler"),
                          [Cluster(**cluster) for cluster in data.get("clusters", [])], data.get("memory_mb"))


def cross_compiler_path(compiler: str, device_name: str) -> str:
    """`compiler` with environment variables expanded, checked to exist; TargetError if not."""
    path = os.path.expandvars(compiler)
    if "$" in path:
        raise TargetError(f"{device_name} needs its cross compiler {compiler!r}: set the variables it "
                          "names (for phones, ANDROID_NDK: the Android NDK's folder)")
    if shutil.which(path) is None:
        hint = ("`apt-get install g++-aarch64-linux-gnu` (or `tightfit device emulate`, which installs it)"
                if "aarch64-linux-gnu" in path else "install it or fix the device description")
        raise TargetError(f"cross compiler {path} for {device_name} is not on this machine: {hint}")
    return path


def export_function(compiler: str, device_name: str):
    """The `fcompile` that links a library for the device with its cross compiler."""
    from tvm.support.cc import cross_compiler

    return cross_compiler(cross_compiler_path(compiler, device_name))


def preset_names() -> list[str]:
    return sorted(path.stem for path in PRESETS_DIR.glob("*.json"))


def load_device(name_or_path: str) -> DeviceSpec:
    """A shipped preset by name, or a description file by path."""
    path = Path(name_or_path)
    if not path.suffix == ".json":
        path = PRESETS_DIR / f"{name_or_path}.json"
    if not path.exists():
        raise TargetError(f"no device {name_or_path!r}: presets are {', '.join(preset_names())}, "
                          "or give a device description .json file")
    try:
        return DeviceSpec.from_json(json.loads(path.read_text()), str(path))
    except (json.JSONDecodeError, TypeError) as err:
        raise TargetError(f"device description {path} is not valid: {err}") from None
