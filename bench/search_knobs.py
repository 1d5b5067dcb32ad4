"""Run the knob search (schedules/knob_search.py) over zoo models into one knob database.

Each model is searched at its first shape set; a bucket shared by several models keeps the
record of the last model searched. Usage (from the repository root):
    .venv/bin/python bench/search_knobs.py bench/knobs/host.json resnet_style mobilenet_v2_style ...
then compile or bench with TIGHTFIT_KNOB_DATABASE=bench/knobs/host.json.
"""

import json
import sys
import time

from tightfit.schedules.knob_search import search
from tightfit.testing import zoo


def main(database: str, names: list[str]) -> None:
    for name in names or zoo.names():
        entry = zoo.get(name)
        started = time.perf_counter()
        results = search(entry.build(), database, entry.shape_sets[0])
        summary = {bucket: {"rows": r["knobs"].rows, "vectors": r["knobs"].vectors,
                            "unroll": r["knobs"].reduction_unroll, "us": r["us"], "tried": r["tried"]}
                   for bucket, r in results.items()}
        print(json.dumps({"model": name, "seconds": round(time.perf_counter() - started, 1),
                          "buckets": summary}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
