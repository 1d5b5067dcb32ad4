"""A dim computed from values and the kernels over it are not fused into one call
(passes/split_blocks_where_dims_are_bound.py): ONNX's window functions, whose length is an
input, compile and match onnxruntime; models whose dims are all bound by their inputs keep their
blocks."""

import numpy as np
import pytest
from tvm import relax

import tightfit
from tightfit.conformance import node_cases
from tightfit.feeds import run_onnxruntime
from tightfit.frontend import import_onnx
from tightfit.passes import SplitBlocksWhereDimsAreBound
from tightfit.pipeline import PipelineOptions, run_pipeline
from tightfit.target import resolve_target
from tightfit.testing import zoo


WINDOW_CASES = ["test_hannwindow_expanded", "test_blackmanwindow_symmetric_expanded"]


@pytest.mark.parametrize("case", WINDOW_CASES)
def test_a_window_whose_length_is_an_input_matches_onnxruntime(case):
    """ONNX's window function bodies: the arange's length and the window's scale come from the
    same chain of scalar kernels, which FuseOps fused with the kernels over the window."""
    model = node_cases()[case].model
    session = tightfit.compile(model).session()
    for length in (1, 5, 16):
        feeds = {"x": np.array(length, np.int32)}
        np.testing.assert_allclose(session.run(feeds)["y"], run_onnxruntime(model, feeds)["y"],
                                   rtol=1e-5, atol=1e-6, err_msg=f"length {length}")


def dataflow_blocks_around_the_split(model) -> tuple[int, int]:
    """The dataflow blocks of `main` as fusion would get them without the split, and with it."""
    legalized, _ = run_pipeline(import_onnx(model).mod, resolve_target("host"), PipelineOptions(),
                                stop_after="AnnotateTIROpPattern")
    count = lambda mod: sum(isinstance(block, relax.DataflowBlock) for block in mod["main"].body.blocks)
    return count(legalized), count(SplitBlocksWhereDimsAreBound()(legalized))


def test_the_block_ends_where_the_window_length_is_bound():
    before, after = dataflow_blocks_around_the_split(node_cases()[WINDOW_CASES[0]].model)
    assert after == before + 1


@pytest.mark.parametrize("name", ["resnet_style", "transformer_encoder"])
def test_models_whose_dims_come_from_their_inputs_keep_their_blocks(name):
    before, after = dataflow_blocks_around_the_split(zoo.get(name).build())
    assert after == before
