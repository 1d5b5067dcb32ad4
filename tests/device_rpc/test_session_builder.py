"""The tuning session's builder: one worker process for every batch, failures reported per candidate."""

import tvm
from tvm.s_tir import meta_schedule as ms
from tvm.script import tirx as T

from tightfit.device_rpc.tuning import SessionBuilder


@T.prim_func(s_tir=True)
def add_one(a: T.Buffer((16,), "float32"), b: T.Buffer((16,), "float32")):
    for i in range(16):
        with T.sblock("b"):
            vi = T.axis.remap("S", [i])
            b[vi] = a[vi] + T.float32(1)


def test_batches_are_built_by_one_worker_and_a_failed_export_fails_its_candidate_alone(tmp_path):
    def export(module):
        import os

        if not os.path.exists(folder):
            raise RuntimeError("no folder to export to")
        path = os.path.join(folder, f"kernel-{os.getpid()}-{len(os.listdir(folder))}.so")
        module.export_library(path)
        return path

    folder = str(tmp_path)
    target = tvm.target.Target({"kind": "llvm"})
    build = ms.builder.BuilderInput(tvm.IRModule({"main": add_one}), target)
    builder = SessionBuilder(timeout_s=60, export=export)
    try:
        batches = [builder.build([build, build]), builder.build([build])]
        folder = str(tmp_path / "missing")  # the next export is sent this folder, and raises
        failed, = builder.build([build])
    finally:
        builder.shutdown()
    paths = [result.artifact_path for batch in batches for result in batch]
    assert all(result.error_msg is None for batch in batches for result in batch)
    assert len(set(paths)) == 3 and len({path.split("-")[-2] for path in paths}) == 1
    assert failed.artifact_path is None and "no folder to export to" in failed.error_msg
