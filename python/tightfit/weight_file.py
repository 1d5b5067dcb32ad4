"""The packed-weight file: pre-transformed weights, page-aligned, deduplicated, mapped not read.

Follows the TFLite XNNPack weight cache (seeds/xnnpack-weight-cache): weights are stored already
in the layout the kernels read, so loading costs no packing and no copy; the file is mapped, so
processes that open the same package share its physical pages; a header says what produced the
blobs, so a stale or corrupt file is detected instead of being used.

Layout, format version 1 (little endian):

    offset 0   magic b"TFWEIGHT"
    offset 8   u32 format version, u32 zero, u64 header length H
    offset 24  header: H bytes of UTF-8 JSON
    ...        zero padding to the next page boundary, then the blobs, each starting on a page
               boundary (the page size in force when written is in the header)

Header fields: `format_version`, `tightfit_version`, `tvm_version`, `target`, `page_size`,
`tensors` (in the order the compiled code takes them: `name`, `blob` index), `blobs` (`dtype`,
`shape`, `offset`, `size`, `sha256` of the stored bytes, `keys`: the content key of every tensor
stored there — a hash of its source weight bytes, the transform that produced it, its layout and
the target), `dedup_saved_bytes`. Tensors with equal dtype, shape and bytes share one blob.

This module imports nothing of tightfit but its errors, so every layer (package, runtime,
benchmarks) may use it.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import CorruptPackageError, StalePackageError

MAGIC = b"TFWEIGHT"
FORMAT_VERSION = 1
_PREAMBLE = struct.Struct("<8sIIQ")


@dataclass(frozen=True)
class WeightTensor:
    """One weight as the compiled code takes it, with its content key (see module docstring)."""

    name: str
    value: np.ndarray
    key: str


@dataclass(frozen=True)
class WriteStats:
    tensors: int
    blobs: int
    file_bytes: int
    payload_bytes: int
    dedup_saved_bytes: int


def content_key(source_digests: list[str], transform: str, layout: str, target: str) -> str:
    """The key of a stored weight: what it was computed from, how, in which layout, for what."""
    digest = hashlib.sha256()
    for part in [*source_digests, transform, layout, target]:
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def write_weight_file(path: str | Path, tensors: list[WeightTensor], provenance: dict) -> WriteStats:
    """Write `tensors` to `path` atomically (temporary file, fsync, rename).

    `provenance` holds `tightfit_version`, `tvm_version` and `target`, checked again at open.
    """
    path = Path(path)
    page = mmap.PAGESIZE
    blobs: list[dict] = []
    blob_data: list[np.ndarray] = []
    blob_by_content: dict[tuple, int] = {}
    entries = []
    saved = 0
    for tensor in tensors:
        data = np.asarray(tensor.value, order="C")  # ascontiguousarray would make 0-d arrays 1-d
        sha = hashlib.sha256(data.tobytes()).hexdigest()
        identity = (str(data.dtype), data.shape, sha)
        index = blob_by_content.get(identity)
        if index is None:
            index = blob_by_content[identity] = len(blobs)
            blobs.append({"dtype": str(data.dtype), "shape": list(data.shape), "size": data.nbytes,
                          "sha256": sha, "keys": []})
            blob_data.append(data)
        else:
            saved += data.nbytes
        blobs[index]["keys"].append(tensor.key)
        entries.append({"name": tensor.name, "blob": index})

    header = {**provenance, "format_version": FORMAT_VERSION, "page_size": page,
              "tensors": entries, "blobs": blobs, "dedup_saved_bytes": saved}
    # Offsets depend on the header's length, which depends on the offsets' digits: lay out with
    # room to spare, then fill in.
    header_room = len(json.dumps(header)) + 32 * len(blobs) + 256
    offset = _round_up(_PREAMBLE.size + header_room, page)
    for blob in blobs:
        blob["offset"] = offset
        offset = _round_up(offset + blob["size"], page)
    encoded = json.dumps(header).encode()
    assert len(encoded) <= header_room

    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as out:
            out.write(_PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, len(encoded)))
            out.write(encoded)
            for blob, data in zip(blobs, blob_data):
                out.write(b"\0" * (blob["offset"] - out.tell()))
                out.write(data.tobytes())
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return WriteStats(tensors=len(entries), blobs=len(blobs), file_bytes=path.stat().st_size,
                      payload_bytes=sum(b["size"] for b in blobs), dedup_saved_bytes=saved)


class WeightFile:
    """An opened weight file: numpy views of the mapped blobs, in the compiled code's order.

    The mapping is private copy-on-write (MAP_PRIVATE): pages come from the page cache and are
    shared with every other process mapping the file, as long as nobody writes to them — nothing
    does; a writable mapping is needed only because DLPack cannot hand TVM a read-only buffer.
    """

    def __init__(self, path: str | Path, expect: dict | None = None, verify: bool = False):
        self.path = Path(path)
        self.header, self._mapping = _open_and_map(self.path)
        if expect:
            stale = {key: (self.header.get(key), value) for key, value in expect.items()
                     if self.header.get(key) != value}
            if stale:
                described = "; ".join(f"{key} is {found!r}, expected {wanted!r}"
                                      for key, (found, wanted) in stale.items())
                raise StalePackageError(f"{self.path} is stale: {described}")
        self._blob_views = [self._view(blob) for blob in self.header["blobs"]]
        if verify:
            self.verify()

    @property
    def names(self) -> list[str]:
        return [entry["name"] for entry in self.header["tensors"]]

    def arrays(self) -> dict[str, np.ndarray]:
        """name → array viewing the mapping (no copy), in the compiled code's argument order."""
        return {entry["name"]: self._blob_views[entry["blob"]] for entry in self.header["tensors"]}

    def verify(self) -> None:
        """Hash every blob; raise CorruptPackageError naming the first that does not match."""
        for index, (blob, view) in enumerate(zip(self.header["blobs"], self._blob_views)):
            if hashlib.sha256(view.tobytes()).hexdigest() != blob["sha256"]:
                names = [e["name"] for e in self.header["tensors"] if e["blob"] == index]
                raise CorruptPackageError(
                    f"{self.path}: blob {index} ({', '.join(names)}) does not match its hash; "
                    "the file is corrupt — rebuild the package")

    def _view(self, blob: dict) -> np.ndarray:
        dtype = np.dtype(blob["dtype"])
        count = blob["size"] // dtype.itemsize
        if count == 0:
            return np.zeros(blob["shape"], dtype=dtype)
        flat = np.frombuffer(self._mapping, dtype=dtype, count=count, offset=blob["offset"])
        return flat.reshape(blob["shape"])


def _open_and_map(path: Path) -> tuple[dict, mmap.mmap | None]:
    if not path.is_file():
        raise CorruptPackageError(f"no weight file at {path}; rebuild the package")
    size = path.stat().st_size
    with open(path, "rb") as weight_file:
        preamble = weight_file.read(_PREAMBLE.size)
        if len(preamble) < _PREAMBLE.size:
            raise CorruptPackageError(f"{path} is truncated ({size} bytes); rebuild the package")
        magic, version, _, header_length = _PREAMBLE.unpack(preamble)
        if magic != MAGIC:
            raise CorruptPackageError(f"{path} is not a tightfit weight file (bad magic)")
        if version != FORMAT_VERSION:
            raise StalePackageError(f"{path} has weight format {version}, this tightfit reads "
                                       f"{FORMAT_VERSION}; rebuild the package")
        try:
            header = json.loads(weight_file.read(header_length))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CorruptPackageError(f"{path} has a corrupt header ({err}); rebuild the package") from err
        mapping = mmap.mmap(weight_file.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
    for blob in header["blobs"]:
        if blob["offset"] + blob["size"] > size:
            raise CorruptPackageError(
                f"{path} is truncated: a blob ends at byte {blob['offset'] + blob['size']} of "
                f"{size}; rebuild the package")
    return header, mapping


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
