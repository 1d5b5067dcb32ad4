"""The fallback schedule runs an elementwise kernel's static inner dims as one loop, and stays exact.

Left as a nest of short loops, LLVM vectorized the loop around the innermost one with gathers
and scatters; fused, the loop walks memory in order. Broadcast operands read through the
indices recovered from the fused loop.
"""

import re

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import relax

from kernel_harness import assert_close, compile_with_kernels, dims, one_op_module, run


def test_static_inner_dims_run_as_one_loop_and_match_numpy_in_both_versions():
    shape = dims("n", 8, 16, 16)
    mod = one_op_module([("x", shape), ("y", shape)], [("bias", (1, 8, 1, 1))],
                        lambda builder, x, y, bias: relax.op.add(builder.emit(relax.op.multiply(x, y)), bias))
    scheduled, executable = compile_with_kernels(mod)
    kernel = next(scheduled[gv].script() for gv in scheduled.functions if gv.name_hint != "main")
    # the parallel version fuses (n, 8) for the pool, the serial one keeps n: both leave the
    # static dims after those as one loop
    inner_loops = re.findall(r"(\w+) in (?:range\(|T\.grid\(n, )T\.int64\((\d+)\)", kernel)
    assert sorted(extent for _, extent in inner_loops) == ["2048", "256"], kernel
    assert all(name.endswith("_fused") for name, _ in inner_loops)
    bias = np.random.default_rng(0).standard_normal((1, 8, 1, 1)).astype(np.float32)

    @settings(max_examples=10, deadline=None)
    @given(st.sampled_from([1, 2, 3, 31, 32, 40]))  # the pool takes over at 32 images
    def check(batch):
        rng = np.random.default_rng(batch)
        x, y = (rng.standard_normal((batch, 8, 16, 16)).astype(np.float32) for _ in range(2))
        assert_close(run(executable, x, y, bias), x * y + bias, f"x * y + bias at batch {batch}")

    check()


def test_a_gather_keeps_its_loop_nest_and_matches_numpy():
    """A nearest-neighbour 2x upsampling concatenated with a map of its size reads rows h / 2:
    no flat offset, so its static dims stay a nest (fused into one loop, each element paid the
    divisions that recover its indices: detector_fpn's upsample-and-concat 12.5 -> 5.3 us)."""
    mod = one_op_module(
        [("small", [1, 8, 8, 12]), ("large", [1, 4, 16, 24])], [],
        lambda builder, small, large: relax.op.concat(
            [builder.emit(relax.op.image.resize2d(small, (16, 24), method="nearest_neighbor",
                                                  coordinate_transformation_mode="asymmetric",
                                                  rounding_method="floor")), large], axis=1))
    scheduled, executable = compile_with_kernels(mod)
    kernel = next(scheduled[gv].script() for gv in scheduled.functions if gv.name_hint != "main")
    assert "T.int64(4608)" not in kernel and "T.int64(2304)" not in kernel, kernel
    rng = np.random.default_rng(0)
    small, large = rng.standard_normal((1, 8, 8, 12)).astype(np.float32), rng.standard_normal((1, 4, 16, 24)).astype(np.float32)
    expected = np.concatenate([small.repeat(2, axis=2).repeat(2, axis=3), large], axis=1)
    assert_close(run(executable, small, large), expected, "upsampled and concatenated")


def test_an_empty_static_dim_compiles_and_gives_an_empty_result():
    # ONNX's CausalConvWithState with kernel size one slices a zero-width state this way
    mod = one_op_module([("x", dims("n", 16, 0))], [], lambda builder, x: relax.op.nn.relu(x))
    _, executable = compile_with_kernels(mod)
    x = np.zeros((3, 16, 0), np.float32)
    assert run(executable, x).shape == (3, 16, 0)


def test_a_block_annotated_materialized_stays_a_buffer_and_others_inline():
    """A gather's per-dim source indices (frontend/ops_pad.py) stay a table the gather reads;
    an unannotated producer of the same form is inlined into its consumer."""
    from tvm import te, tirx

    from tightfit.schedules.fallback_cpu import MATERIALIZED, schedule_prim_func

    n = tirx.Var("n", "int64")
    data = te.placeholder((n, 16), "float32", "data")

    def gather(attrs):
        rows = te.compute((n,), lambda i: tirx.floormod(i + 1, n), name="rows", attrs=attrs)
        return te.compute((n, 16), lambda i, j: data[rows[i], j], name="gathered")

    for attrs, blocks in [({MATERIALIZED: 1}, {"rows", "gathered"}), ({}, {"gathered"})]:
        func = schedule_prim_func(te.create_prim_func([data, gather(attrs)]))
        names = set(re.findall(r'T\.sblock\("(\w+)"\)', func.script()))
        assert names - {"root"} - {name for name in names if name.startswith("version")} == blocks
