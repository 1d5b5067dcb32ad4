"""The knob search measures candidates for each kernel bucket, records the fastest in the
on-disk database keyed by target, kind and bucket, and compiles then use the record."""

import json

import numpy as np
from test_kernel_versions import attention_scores_model, conv_model, dense_model

import tightfit
from tightfit.feeds import run_onnxruntime
from tightfit.frontend import import_onnx
from tightfit.pipeline import PipelineOptions, run_pipeline
from tightfit.schedules.isa import AVX512, isa_for_target
from tightfit.schedules.knob_database import KnobDatabase
from tightfit.schedules.knob_search import candidate_knobs, search
from tightfit.schedules.register_tile import SYMBOLIC_COLUMNS, TileKnobs
from tightfit.target import resolve_target
from tvm import tirx


def test_search_records_the_fastest_candidate_and_compiles_use_it(tmp_path):
    database = tmp_path / "knobs.json"
    model = dense_model(40)
    results = search(model, database, {"x": (37, 24)}, max_candidates=3)

    lanes = isa_for_target(resolve_target("host").tvm_target).lanes
    bucket = f"dense_packed/v{-(-40 // lanes)}/mdyn"  # 40 columns: 3 AVX-512 vectors, 5 AVX2 ones
    assert list(results) == [bucket]
    stored = json.loads(database.read_text())["targets"][str(resolve_target("host").tvm_target)]
    record = stored["tiles"][bucket]
    assert results[bucket]["tried"] == 3
    assert record["us"] == results[bucket]["us"] > 0
    assert stored["min_parallel_work"] >= 1

    options = PipelineOptions(knob_database=str(database))
    scheduled, _ = run_pipeline(import_onnx(model).mod, resolve_target("host"), options,
                                stop_after="tightfit.FallbackCPUSchedule")
    assert f'"tightfit.rows": {record["rows"]}' in scheduled.script()
    feeds = {"x": np.random.default_rng(0).standard_normal((37, 24)).astype(np.float32)}
    ours = tightfit.compile(model, options=options).session().run(feeds)
    np.testing.assert_allclose(ours["y"], run_onnxruntime(model, feeds)["y"], rtol=1e-4, atol=1e-5)


def test_a_search_over_symbolic_columns_records_what_compiles_look_up(tmp_path):
    """Attention's scores (columns = the sequence): the search keys the kernel by the column
    count SelectGemmKernel tiles a symbolic one for, so the compile finds the record (a search
    that keyed it as 64 columns wrote records no compile read)."""
    database = tmp_path / "knobs.json"
    model = attention_scores_model()
    results = search(model, database, {"q": (2, 20, 8), "k": (2, 8, 20)}, max_candidates=2)
    lanes = isa_for_target(resolve_target("host").tvm_target).lanes
    bucket = f"matmul_packed_rhs/v{-(-SYMBOLIC_COLUMNS // lanes)}/mdyn"
    assert list(results) == [bucket]
    knobs = results[bucket]["knobs"]
    target = resolve_target("host").tvm_target
    looked_up = KnobDatabase.open(str(database), target).tile_knobs(
        "matmul_packed_rhs", SYMBOLIC_COLUMNS, tirx.Var("s", "int64"), isa_for_target(target))
    assert looked_up == knobs
    scheduled, _ = run_pipeline(import_onnx(model).mod, resolve_target("host"),
                                PipelineOptions(knob_database=str(database)),
                                stop_after="tightfit.FallbackCPUSchedule")
    assert f'"tightfit.rows": {knobs.rows}' in scheduled.script()


def test_candidates_fit_the_register_budget_and_the_columns():
    isa = isa_for_target(resolve_target({"kind": "llvm", "mtriple": "aarch64-linux-gnu",
                                         "mattr": ["+neon"]}).tvm_target)
    candidates = candidate_knobs("conv2d_direct/v2/m32", isa)
    assert candidates and all(isa.fits_registers(c.rows, c.vectors) for c in candidates)
    assert {c.vectors for c in candidates} == {1, 2}
    assert {c.reduction_unroll for c in candidates} == {1, 4}


def test_a_recorded_reduction_unroll_reaches_the_kernel(tmp_path):
    """The database's unroll knob splits and unrolls the innermost reduction loop (before it
    was measured by the search but never passed to the kernels)."""
    model = dense_model(40)
    target = resolve_target("host")
    isa = isa_for_target(target.tvm_target)
    scripts = {}
    for unroll in (1, 4):
        database = KnobDatabase.open(tmp_path / f"unroll{unroll}.json", target.tvm_target)
        database.record_tiles("dense_packed", 40, tirx.Var("m", "int64"), isa,
                              TileKnobs(8, 1, unroll), 1.0, "x=37x24")
        database.save()
        options = PipelineOptions(knob_database=str(database.path))
        scheduled, _ = run_pipeline(import_onnx(model).mod, target, options,
                                    stop_after="tightfit.FallbackCPUSchedule")
        scripts[unroll] = scheduled.script()
        feeds = {"x": np.random.default_rng(1).standard_normal((37, 24)).astype(np.float32)}
        ours = tightfit.compile(model, options=options).session().run(feeds)
        np.testing.assert_allclose(ours["y"], run_onnxruntime(model, feeds)["y"], rtol=1e-4, atol=1e-5)
    assert '"tightfit.reduction_unroll": 4' in scripts[4]
    assert scripts[4].count("T.unroll") > scripts[1].count("T.unroll")


def test_search_covers_width_vector_convs_and_compiles_use_the_recorded_channel_rows(tmp_path):
    """The conv kernel most convs run in: its channel rows are searched (here 16 output
    channels over a symbolic width), starting from the rows a compile uses now."""
    database = tmp_path / "knobs.json"
    model = conv_model(8, 16, 1, kernel=3, height=6)
    results = search(model, database, {"x": (1, 8, 6, 37)}, max_candidates=3)
    (bucket,) = results
    assert bucket == "conv2d_width_vectors/c16/mdyn" and results[bucket]["tried"] == 3
    record = json.loads(database.read_text())["targets"][str(resolve_target("host").tvm_target)]["tiles"][bucket]
    options = PipelineOptions(knob_database=str(database))
    scheduled, _ = run_pipeline(import_onnx(model).mod, resolve_target("host"), options,
                                stop_after="tightfit.FallbackCPUSchedule")
    assert f'"tightfit.channel_rows": {record["rows"]}' in scheduled.script()
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 8, 6, 29)).astype(np.float32)}
    ours = tightfit.compile(model, options=options).session().run(feeds)
    expected = run_onnxruntime(model, feeds)
    np.testing.assert_allclose(ours["y"], expected["y"], rtol=1e-4, atol=1e-5)


def test_width_vector_candidates_put_tiles_that_fit_the_channels_first():
    """Channel rows x one or two pixel vectors, no unroll knob; for 16 channels the tiles
    that cover them without padding come before the tallest ones."""
    candidates = candidate_knobs("conv2d_width_vectors/c16/mdyn", AVX512)
    assert {c.vectors for c in candidates} == {1, 2} and {c.reduction_unroll for c in candidates} == {1}
    assert all(AVX512.fits_registers(c.rows, c.vectors) for c in candidates)
    order = [(c.rows, c.vectors) for c in candidates]
    assert order.index((8, 1)) < order.index((15, 1)) and order.index((4, 2)) < order.index((7, 2))


def test_buckets_the_database_holds_are_not_searched_again_unless_remeasured(tmp_path):
    database, model, shapes = tmp_path / "knobs.json", dense_model(40), {"x": (37, 24)}
    first = search(model, database, shapes, max_candidates=2)
    heard = []
    again = search(model, database, shapes, max_candidates=2, progress=heard.append)
    assert heard == []  # no tile rounds, and the recorded parallel threshold is kept
    (bucket,) = first
    assert again[bucket] == {**first[bucket], "tried": 0, "measured_before": True}
    remeasured = search(model, database, shapes, max_candidates=2, progress=heard.append, remeasure=True)
    assert remeasured[bucket]["tried"] == 2 and not remeasured[bucket]["measured_before"]
    assert "parallel threshold" in heard
