"""Weight prefetch on and off (schedules/prefetch.py) in whole zoo models, in one process.

Each model is compiled twice: as tightfit builds it, and with PREFETCH_MIN_WEIGHT_BYTES out of
reach, so that no conv prefetches its weights; a prefetch changes no arithmetic, so both must
give the same outputs bit for bit. The two sessions take turns, the order swapped every round
(the second of a pair ran a few percent faster on a busy host); a turn pauses and warms up as
`tightfit bench`'s do, then takes the median of 10 timed runs. The table gives each side's
median over the rounds and their ratio. Usage:
    .venv/bin/python bench/weight_prefetch.py [rounds] [model ...]
"""

import statistics
import sys
import time

import numpy as np

import tightfit
import tightfit.schedules.conv2d as conv2d
from tightfit.bench import PAUSE_BETWEEN_ENGINES_S, WARM_UP_PER_TURN_S, run_for
from tightfit.feeds import random_feeds
from tightfit.frontend import declared_inputs
from tightfit.testing import zoo

MODELS = ["mobilenet_v2", "resnet18"]
RUNS_PER_TURN = 10


def compile_with_min_weight_bytes(model, min_weight_bytes: int):
    built = conv2d.PREFETCH_MIN_WEIGHT_BYTES
    conv2d.PREFETCH_MIN_WEIGHT_BYTES = min_weight_bytes
    try:
        return tightfit.compile(model).session()
    finally:
        conv2d.PREFETCH_MIN_WEIGHT_BYTES = built


def turn_seconds(session, feeds) -> float:
    time.sleep(PAUSE_BETWEEN_ENGINES_S)
    run_for(session.run, feeds, WARM_UP_PER_TURN_S)
    times = []
    for _ in range(RUNS_PER_TURN):
        start = time.perf_counter()
        session.run(feeds)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(rounds: int, names: list[str]) -> None:
    print("| model | shape | prefetch ms | no prefetch ms | ratio |")
    print("|---|---|---|---|---|")
    for name in names:
        entry = zoo.get(name)
        model = entry.build()
        sessions = {"on": compile_with_min_weight_bytes(model, conv2d.PREFETCH_MIN_WEIGHT_BYTES),
                    "off": compile_with_min_weight_bytes(model, 1 << 62)}
        for shapes in entry.shape_sets:
            feeds = (entry.feeds(shapes) if entry.feeds
                     else random_feeds(declared_inputs(model.graph), shapes, seed=0))
            outputs = {side: session.run(feeds) for side, session in sessions.items()}
            for output, value in outputs["on"].items():
                np.testing.assert_array_equal(value, outputs["off"][output])
            times = {side: [] for side in sessions}
            for round_index in range(rounds):
                order = ["on", "off"] if round_index % 2 == 0 else ["off", "on"]
                for side in order:
                    times[side].append(turn_seconds(sessions[side], feeds))
            on, off = (statistics.median(times[side]) * 1e3 for side in ("on", "off"))
            shape = "; ".join(f"{k}={'x'.join(map(str, v))}" for k, v in shapes.items())
            print(f"| {name} | {shape} | {on:.3f} | {off:.3f} | {on / off:.3f} |", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20, sys.argv[2:] or MODELS)
