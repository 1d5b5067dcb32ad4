"""KeepReshapesAsViews: the reshape kernels LegalizeOps marks become views after fusion."""

import tvm
from tvm import relax
from tvm.script import relax as R
from tvm.script import tirx as T

from tightfit.passes import KeepReshapesAsViews, legalize_views


def _shuffle_module() -> tvm.IRModule:
    """grouped_convnet's channel shuffle after a strided stage, over a symbolic batch, H and W."""

    @tvm.script.ir_module
    class Shuffle:
        @R.function
        def main(x: R.Tensor(("n", 6, "h", "w"), "float32")):
            n = T.int64()
            h = T.int64()
            w = T.int64()
            with R.dataflow():
                # a stride-4 subsampling: the map is ((h - 1) // 4 + 1) x ((w - 1) // 4 + 1)
                small = R.nn.max_pool2d(x, pool_size=[1, 1], strides=[4, 4])
                grouped = R.reshape(small, R.shape([n, 2, 3, ((h - 1) // 4 + 1) * ((w - 1) // 4 + 1)]))
                shuffled = R.permute_dims(grouped, [0, 2, 1, 3])
                back = R.reshape(shuffled, R.shape([n, 6, (h - 1) // 4 + 1, (w - 1) // 4 + 1]))
                out = R.nn.relu(back)
                R.output(out)
            return out

    return Shuffle


def _lowered(passes) -> tvm.IRModule:
    mod = _shuffle_module()
    for compiler_pass in [relax.transform.LegalizeOps(legalize_views()),
                          relax.transform.AnnotateTIROpPattern(), relax.transform.FuseOps(),
                          relax.transform.FuseTIR(), *passes,
                          relax.transform.DeadCodeElimination()]:
        mod = compiler_pass(mod)
    return mod


def test_reshape_kernels_left_alone_by_fusion_become_views():
    """Both reshapes of the shuffle become the VM's reshape of their input, and no reshape
    kernel is left; TVM's own rewrite keeps both as copy kernels: it cannot prove their index
    arithmetic (divisions by the symbolic map extents) a reshape."""
    ours = _lowered([KeepReshapesAsViews()])
    text = ours["main"].script()
    assert "R.reshape(small, R.shape([n, 2, 3," in text
    assert "R.reshape(shuffled, R.shape([n, 6," in text
    assert not [gv for gv in ours.functions if gv.name_hint.startswith("reshape")]
    theirs = _lowered([relax.transform.RewriteDataflowReshape()])
    assert len([gv for gv in theirs.functions if gv.name_hint.startswith("reshape")]) == 2
