"""Model inputs for the CLI and benchmarks: parse `--shape`, load `.npz`, make random feeds,
and run onnxruntime as the reference.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from .errors import InputError, TightfitError
from .frontend import TensorSpec


def parse_shape_option(text: str) -> tuple[str, list[int | str]]:
    """`NAME=1,3,H,W` → ("NAME", [1, 3, "H", "W"]); digits become ints, the rest symbol names."""
    name, separator, dims = text.rpartition("=")
    if not separator or not name or not dims:
        raise InputError(f"--shape {text!r} is not NAME=DIM,DIM,...; e.g. --shape input=1,3,224,224")
    return name, [int(dim) if dim.lstrip("-").isdigit() else dim for dim in dims.split(",")]


def concrete_shapes(specs: list[TensorSpec], given: dict[str, list[int | str]],
                    default_dim: int | None = None,
                    option: str = "--shape") -> dict[str, tuple[int, ...]]:
    """A concrete shape for every input: declared static dims, `given` ones, symbols shared.

    A symbol bound by one input's given shape applies to every input that uses it; a dim that
    stays unknown takes `default_dim`, or is an InputError listing what to pass.
    """
    symbol_values: dict[str, int] = {}
    for spec in specs:
        if spec.name in given and spec.shape is not None:
            for declared, value in zip(spec.shape, given[spec.name]):
                if isinstance(declared, str) and isinstance(value, int):
                    symbol_values[declared] = value
    shapes = {}
    unresolved = []
    for spec in specs:
        dims = given.get(spec.name, spec.shape)
        if dims is None:
            unresolved.append(f"{spec.name} (unknown rank)")
            continue
        resolved = []
        for dim in dims:
            value = dim if isinstance(dim, int) else symbol_values.get(dim, default_dim)
            if value is None:
                unresolved.append(f"{spec.name} dim {dim}")
            resolved.append(value)
        shapes[spec.name] = tuple(resolved)
    if unresolved:
        example = " ".join(f"{option} {s.name}={','.join(str(d) for d in (s.shape or ['...']))}"
                           for s in specs)
        raise InputError(f"dynamic dims need values: {', '.join(unresolved)}; pass e.g. {example} "
                         "with numbers in place of the names")
    return shapes


def random_feeds(specs: list[TensorSpec], shapes: dict[str, tuple[int, ...]],
                 seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs: standard normal floats, small non-negative ints, fair booleans."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for spec in specs:
        shape = shapes[spec.name]
        dtype = np.dtype(spec.dtype)
        if dtype.kind == "f":
            feeds[spec.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind in "iu":
            feeds[spec.name] = rng.integers(0, 4, size=shape).astype(dtype)
        elif dtype.kind == "b":
            feeds[spec.name] = rng.random(shape) < 0.5
        else:
            raise InputError(f"cannot make random values of {dtype} for input {spec.name}; "
                             "pass the inputs as an .npz file")
    return feeds


def load_npz(path: str | Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path) as archive:
            return {name: archive[name] for name in archive.files}
    except (OSError, ValueError) as err:
        raise InputError(f"cannot read inputs from {path}: {err}; save them with "
                         "numpy.savez(path, input_name=array, ...)") from err


def run_onnxruntime(model: onnx.ModelProto | str | Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Outputs of onnxruntime (default session options) for `feeds`, by output name."""
    try:
        import onnxruntime
    except ImportError as err:
        raise TightfitError("comparing with onnxruntime needs it installed: "
                            "pip install onnxruntime") from err
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    session = onnxruntime.InferenceSession(source, providers=["CPUExecutionProvider"])
    names = [output.name for output in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def max_abs_error(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> float:
    """The largest |actual - expected| over all outputs (inf on a shape mismatch)."""
    worst = 0.0
    for name, reference in expected.items():
        value = actual[name]
        if value.shape != reference.shape:
            return float("inf")
        if reference.size:
            difference = np.abs(value.astype(np.float64) - reference.astype(np.float64))
            worst = max(worst, float(np.nanmax(difference)))
    return worst
