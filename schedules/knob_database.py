"""The on-disk database of measured kernel knobs and cost-model rates.

MNN's semi-automatic search (between hand-written kernels and full auto-tuning): every
tightfit kernel exposes a few knobs (register tile rows and vectors, reduction unroll), a short
search measures tens of candidates per distinct shape on the target (knob_search.py), and the
best are kept here, keyed by target, kernel kind and shape bucket; cost-model rates measured on
the target (conv_cost.py) are kept beside them. Kernel selection reads it at compile time;
nothing is measured during a compile.

File format (JSON, one file, written atomically):
    {"format": 1,
     "targets": {"<target string>": {
         "tiles": {"<kind>/<bucket>": {"rows": 8, "vectors": 2, "reduction_unroll": 1,
                                        "us": 12.5, "shape": "..."}},
         "rates": {"macs_per_second": ..., "bytes_per_second": ...,
                   "transform_flops_per_second": ...},
         "conv_algorithms": {"<conv key>": {"us": {"width_vectors": 12.1, "winograd_f2": null},
                                            "shape": "1x12x16x16"}},
         "min_parallel_work": 131072}}}
Bucket: `v<panel vectors needed, at most 8>/m<row extent bucket>`, where the row extent bucket
is `dyn` for a symbolic extent and the next power of two (at most 1024) otherwise; a
width-vectors conv's (kinds conv2d.tile_kind) has `c<output channels>` in place of `v...`: its
tile's rows are output channels, chosen against their exact count.
Conv key: conv_cost.ConvShape.measurement_key (attributes, batch, height, width); its record
holds each candidate algorithm's time on the target (None: failed there) and the input shape
it was timed at (python/tightfit/algorithm_search.py).
MetaSchedule tuning records, where a database of them exists, are applied separately and win.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import tvm
from tvm import tirx

from .conv2d import WIDTH_VECTORS
from .dispatch import DEFAULT_MIN_PARALLEL_WORK
from .isa import VectorISA
from .register_tile import TileKnobs

FORMAT = 1
ENV_VARIABLE = "TIGHTFIT_KNOB_DATABASE"


class KnobDatabase:
    def __init__(self, path: Path | None, target_key: str, data: dict):
        self.path = path
        self.target_key = target_key
        self.data = data

    @staticmethod
    def open(path: str | Path | None, target: tvm.target.Target | None) -> KnobDatabase:
        """Open `path` (or $TIGHTFIT_KNOB_DATABASE); no path means an empty in-memory database."""
        path = path or os.environ.get(ENV_VARIABLE)
        target_key = str(target) if target is not None else "llvm"
        data = {"format": FORMAT, "targets": {}}
        if path is not None and Path(path).exists():
            loaded = json.loads(Path(path).read_text())
            if loaded.get("format") == FORMAT:
                data = loaded
        return KnobDatabase(Path(path) if path else None, target_key, data)

    def _entry(self) -> dict:
        return self.data["targets"].setdefault(self.target_key, {"tiles": {}, "rates": {}})

    def tile_knobs(self, kind: str, columns: int, row_extent, isa: VectorISA) -> TileKnobs | None:
        record = self.bucket_record(bucket_key(kind, columns, row_extent, isa))
        if record is None:
            return None
        return TileKnobs(int(record["rows"]), int(record["vectors"]),
                         int(record.get("reduction_unroll", 1)))

    def bucket_record(self, bucket: str) -> dict | None:
        """The record of a bucket (its knobs, time and the shape it was measured at), if any."""
        record = self._entry()["tiles"].get(bucket)
        return None if record is None else dict(record)

    def rates(self) -> dict:
        return dict(self._entry()["rates"])

    def record_tiles(self, kind: str, columns: int, row_extent, isa: VectorISA, knobs: TileKnobs,
                     microseconds: float, shape: str) -> None:
        self.record_bucket(bucket_key(kind, columns, row_extent, isa), knobs, microseconds, shape)

    def record_bucket(self, bucket: str, knobs: TileKnobs, microseconds: float, shape: str) -> None:
        self._entry()["tiles"][bucket] = {
            "rows": knobs.rows, "vectors": knobs.vectors,
            "reduction_unroll": knobs.reduction_unroll, "us": round(microseconds, 3),
            "shape": shape}

    def min_parallel_work(self) -> int:
        """Loop work below which a kernel runs serially (dispatch.py); measured or default."""
        return int(self._entry().get("min_parallel_work", DEFAULT_MIN_PARALLEL_WORK))

    def has_min_parallel_work(self) -> bool:
        return "min_parallel_work" in self._entry()

    def record_min_parallel_work(self, work: int) -> None:
        self._entry()["min_parallel_work"] = int(work)

    def conv_times(self, key: str) -> dict | None:
        """Microseconds per candidate algorithm of the conv with this key, where measured."""
        record = self.conv_record(key)
        return None if record is None else record["us"]

    def conv_record(self, key: str) -> dict | None:
        """The conv key's record: {"us": {algorithm: microseconds or None}, "shape": the input
        it was timed at, e.g. "1x12x16x16"}, if any."""
        record = self._entry().get("conv_algorithms", {}).get(key)
        return None if record is None else {"us": dict(record["us"]), "shape": record["shape"]}

    def record_conv_times(self, key: str, microseconds: dict, shape: str) -> None:
        self._entry().setdefault("conv_algorithms", {})[key] = {
            "us": {name: None if us is None else round(us, 3) for name, us in microseconds.items()},
            "shape": shape}

    def record_rates(self, rates: dict) -> None:
        self._entry()["rates"].update(rates)

    def save(self) -> None:
        if self.path is None:
            raise ValueError("this knob database has no file; open it with a path to save")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=".knobs-")
        with os.fdopen(handle, "w") as out:
            json.dump(self.data, out, indent=1, sort_keys=True)
        os.replace(temporary, self.path)


def bucket_key(kind: str, columns: int, row_extent, isa: VectorISA) -> str:
    if kind.startswith(WIDTH_VECTORS):
        column_part = f"c{int(columns)}"
    else:
        column_part = f"v{min(8, max(1, -(-int(columns) // isa.lanes)))}"
    if isinstance(row_extent, (int, tirx.IntImm)):
        extent = int(row_extent)
        rows = "1" if extent <= 1 else str(min(1024, 1 << (extent - 1).bit_length()))
    else:
        rows = "dyn"
    return f"{kind}/{column_part}/m{rows}"
