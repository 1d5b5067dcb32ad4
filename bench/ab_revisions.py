"""Whole runs of zoo models as another git revision builds them against this working tree's
builds, both timed in one process in alternating turns.

A change worth a few percent is invisible between two bench runs on a shared host, whose
speed drifts by more than that within minutes; measured in one process, turn by turn, a drift
slows both sides alike and the median of the per-turn ratios keeps the difference. The other
revision is checked out into a temporary git worktree and compiles the models in a process of
its own (its modules imported from the worktree); its packages are then loaded here beside
this tree's. Both must write the same package format (package.FORMAT_VERSION). Each turn
times a side's run inside the VM (Session.time_run: no Python around it), median of 5 x 20
runs. Usage:
    .venv/bin/python bench/ab_revisions.py REV [NAME ...] [--turns 15]
NAMEs are zoo models (default: the small dynamic ones the 20x target misses).
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import tightfit
from tightfit.feeds import random_feeds
from tightfit.testing import zoo

REPOSITORY = Path(__file__).resolve().parent.parent
DEFAULT_MODELS = ["gated_skip_block", "nonzero_gather", "nonzero_rows_tied",
                  "transformer_encoder_dynamo", "transformer_encoder", "torch_transformer_layers"]

# Run in the other revision's worktree: imports its tightfit from there (the package dirs its
# pyproject maps), compiles each zoo model and saves the package.
COMPILE_AT_REVISION = """
import importlib.util, sys, tomllib
from pathlib import Path
root, out, names = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
package_dirs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


class WorktreeFinder:
    def find_spec(self, name, path=None, target=None):
        if name not in package_dirs:
            return None
        folder = root / package_dirs[name]
        return importlib.util.spec_from_file_location(
            name, folder / "__init__.py", submodule_search_locations=[str(folder)])


sys.meta_path.insert(0, WorktreeFinder())
import tightfit
from tightfit.testing import zoo
assert Path(tightfit.__file__).is_relative_to(root), tightfit.__file__
for name in names:
    tightfit.compile(zoo.get(name).build()).save(out / f"{name}.tfpkg")
"""


def compile_at_revision(revision: str, names: list[str], out: Path) -> None:
    """Packages of `names` as `revision` compiles them, written to `out`."""
    worktree = out / "worktree"
    subprocess.run(["git", "-C", str(REPOSITORY), "worktree", "add", "--detach", "--quiet",
                    str(worktree), revision], check=True)
    try:
        subprocess.run([sys.executable, "-c", COMPILE_AT_REVISION, str(worktree), str(out), *names],
                       check=True)
    finally:
        subprocess.run(["git", "-C", str(REPOSITORY), "worktree", "remove", "--force",
                        str(worktree)], check=True)


def vm_seconds(session, feeds) -> float:
    return float(np.median(session.time_run(feeds, number=20, repeat=5)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revision", help="a git revision to compare this working tree against")
    parser.add_argument("names", nargs="*", default=DEFAULT_MODELS, help="zoo models")
    parser.add_argument("--turns", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tightfit-ab-") as folder:
        compile_at_revision(args.revision, args.names, Path(folder))
        print(f"| model | shape | {args.revision} us | this tree us | ratio (median per turn) "
              "| max abs difference |")
        print("|---|---|---|---|---|---|")
        for name in args.names:
            entry = zoo.get(name)
            theirs = tightfit.load(Path(folder) / f"{name}.tfpkg").session()
            ours = tightfit.compile(entry.build()).session()
            for shapes in entry.shape_sets:
                feeds = (entry.feeds(shapes) if entry.feeds
                         else random_feeds(ours.package.inputs, shapes))
                expected, got = theirs.run(feeds), ours.run(feeds)
                difference = max(float(np.max(np.abs(expected[key] - got[key]), initial=0))
                                 for key in expected)
                turns = [(vm_seconds(theirs, feeds), vm_seconds(ours, feeds))
                         for _ in range(args.turns)]
                before, after = (statistics.median(turn[side] for turn in turns) * 1e6
                                 for side in (0, 1))
                ratio = statistics.median(turn[1] / turn[0] for turn in turns)
                shape = "; ".join(f"{key}={'x'.join(map(str, value))}"
                                  for key, value in shapes.items())
                print(f"| {name} | {shape} | {before:.2f} | {after:.2f} | {ratio:.3f} "
                      f"| {difference:.1e} |", flush=True)


if __name__ == "__main__":
    main()
