"""The RDP models of `tightfit.testing.rdp_cases`, each with a hypothesis strategy for its inputs.

`draw_inputs(draw)` takes hypothesis' `draw`, so that every shape drawn is one onnxruntime
accepts. Data-dependent choices (which rows NonZero keeps, which branch an If takes) are drawn too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx

from tightfit.testing.rdp_cases import (if_different_shapes, if_same_symbolic_shape, nonzero_rows_tied,
                                        reshape_to_computed_shape)


@dataclass(frozen=True)
class RDPCase:
    name: str
    build: Callable[[], onnx.ModelProto]
    draw_inputs: Callable  # draw -> dict of input name -> array
    description: str


def _draw_reshape_inputs(draw):
    from hypothesis import strategies as st

    batch = draw(st.integers(1, 4))
    seq = 2 * draw(st.integers(1, 12))  # batch·seq·16 must split into rows of 32
    return {"x": np.random.default_rng(batch * 100 + seq).standard_normal((batch, seq, 16)).astype(np.float32)}


def _draw_nonzero_inputs(draw):
    from hypothesis import strategies as st

    rows = draw(st.integers(1, 12))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    return {"x": rng.standard_normal((rows, 4)).astype(np.float32),
            "v": rng.standard_normal((rows, 8)).astype(np.float32)}


def _draw_if_inputs(draw):
    from hypothesis import strategies as st

    batch = draw(st.integers(1, 5))
    sign = draw(st.sampled_from([1.0, -1.0]))  # drives the If both ways
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    return {"x": (rng.standard_normal((batch, 6)) + 2 * sign).astype(np.float32)}


CASES = [
    RDPCase("reshape_to_computed_shape", reshape_to_computed_shape, _draw_reshape_inputs,
            "Reshape to targets computed from the input's shape"),
    RDPCase("nonzero_rows_tied", nonzero_rows_tied, _draw_nonzero_inputs,
            "NonZero count tied to an input dim by MatMul (backward propagation)"),
    RDPCase("if_same_symbolic_shape", if_same_symbolic_shape, _draw_if_inputs,
            "If whose branches give the same symbolic shape (Merge keeps it)"),
    RDPCase("if_different_shapes", if_different_shapes, _draw_if_inputs,
            "If whose branches give different shapes (Merge gives nac)"),
]
BY_NAME = {case.name: case for case in CASES}
