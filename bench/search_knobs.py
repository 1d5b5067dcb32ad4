"""Run `tightfit search` (conv algorithms, then register tiles and the parallel threshold) over
zoo models into one knob database.

Each model is searched at its first shape set; a conv key or tile bucket shared by several
models is timed for the first model that has it, and the later ones take that record (the
database is a cache; rerun into a fresh file to time everything again). Usage (from the
repository root):
    .venv/bin/python bench/search_knobs.py bench/knobs/host.json resnet_style mobilenet_v2_style ...
then compile or bench with TIGHTFIT_KNOB_DATABASE=bench/knobs/host.json.
"""

import json
import sys
import time

from tightfit.algorithm_search import search_conv_algorithms
from tightfit.schedules.knob_search import search
from tightfit.testing import zoo


def main(database: str, names: list[str]) -> None:
    for name in names or zoo.names():
        entry = zoo.get(name)
        started = time.perf_counter()
        convs = search_conv_algorithms(entry.build(), entry.shape_sets[0], database)
        results = search(entry.build(), database, entry.shape_sets[0])
        summary = {bucket: {"rows": r["knobs"].rows, "vectors": r["knobs"].vectors,
                            "unroll": r["knobs"].reduction_unroll, "us": r["us"], "tried": r["tried"]}
                   for bucket, r in results.items()}
        algorithms = {t.key: {"estimated": t.estimated_choice, "measured": t.measured_choice}
                      for t in convs}
        print(json.dumps({"model": name, "seconds": round(time.perf_counter() - started, 1),
                          "conv_algorithms": algorithms, "tiles": summary}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
