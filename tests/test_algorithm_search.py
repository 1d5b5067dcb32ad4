"""Conv algorithms timed on the target (algorithm_search.py) and chosen by those times."""

import json

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import tightfit
from tightfit.algorithm_search import search_conv_algorithms
from tightfit.cli import main
from tightfit.feeds import max_abs_error, run_onnxruntime
from tightfit.frontend import import_onnx
from tightfit.pipeline import PipelineOptions, run_pipeline
from tightfit.schedules.conv_cost import (
    MEASURED_MARGIN,
    ConvShape,
    Rates,
    candidate_costs,
    choose,
    with_measurements,
)
from tightfit.schedules.isa import AVX512
from tightfit.schedules.knob_database import KnobDatabase
from tightfit.target import resolve_target
from tvm import tirx


def conv_net():
    """Two 3x3 convs of one shape (one key), a strided 1x1 conv, and a depthwise conv (one
    candidate: nothing to time); batch, height and width dynamic."""
    rng = np.random.default_rng(0)

    def weight(name, shape):
        return numpy_helper.from_array((rng.standard_normal(shape) / 8).astype(np.float32), name)

    conv = helper.make_node
    nodes = [
        conv("Conv", ["x", "w1"], ["a"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        conv("Relu", ["a"], ["b"]),
        conv("Conv", ["b", "w2"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        conv("Conv", ["c", "w3"], ["d"], kernel_shape=[1, 1], strides=[2, 2]),
        conv("Conv", ["d", "w4"], ["y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=16),
    ]
    graph = helper.make_graph(
        nodes, "conv_net",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8, "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 16, "oh", "ow"])],
        [weight("w1", (8, 8, 3, 3)), weight("w2", (8, 8, 3, 3)), weight("w3", (16, 8, 1, 1)),
         weight("w4", (16, 1, 3, 3))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def conv1d_net():
    rng = np.random.default_rng(1)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3], strides=[2], pads=[1, 1])],
        "conv1d_net", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 12, "t"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 16, "ot"])],
        [numpy_helper.from_array(rng.standard_normal((16, 12, 3)).astype(np.float32), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def chosen_algorithms(model, knobs) -> list[tuple[str, str, list[dict]]]:
    """(conv key, algorithm, candidate records) of every conv kernel SelectConvAlgorithm emits."""
    mod, _ = run_pipeline(import_onnx(model).mod, resolve_target("host"),
                          PipelineOptions(knob_database=str(knobs)),
                          stop_after="tightfit.SelectConvAlgorithm")
    return [(str(func.attrs["tightfit.conv_key"]), str(func.attrs["tightfit.algorithm"]),
             [{key: value for key, value in record.items()} for record in func.attrs["tightfit.candidates"]])
            for func in mod.functions.values()
            if isinstance(func, tirx.PrimFunc) and func.attrs and "tightfit.conv_key" in func.attrs]


def test_measured_times_outrank_the_estimates_within_the_workspace_limit():
    shape = ConvShape(1, 64, 56, 56, 64, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 1)
    estimates = candidate_costs(shape, AVX512, Rates.for_target(AVX512, 2, None))
    assert choose(estimates, None).name == "winograd_f4"
    measured = {"direct": 300.0, "width_vectors": 200.0, "im2col": 150.0, "winograd_f2": 400.0,
                "winograd_f4": None}  # failed on the target: never chosen
    candidates = with_measurements(estimates, measured)
    assert {c.name for c in candidates} == {"direct", "width_vectors", "im2col", "winograd_f2"}
    assert choose(candidates, None).name == "im2col"
    im2col = next(c for c in candidates if c.name == "im2col")
    assert choose(candidates, im2col.workspace_bytes - 1).name == "width_vectors"
    assert with_measurements(estimates, None) == estimates
    assert with_measurements(estimates, {"winograd_f4": None}) == estimates


def test_a_measured_near_tie_keeps_the_cost_models_pick():
    """Within MEASURED_MARGIN the model's pick stays: a conv timed alone in cache is not the
    conv inside a model, and near-ties are noise."""
    shape = ConvShape(1, 64, 56, 56, 64, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 1)
    estimates = candidate_costs(shape, AVX512, Rates.for_target(AVX512, 2, None))
    close = {"winograd_f4": 100.0, "direct": 100.0 / (1 + MEASURED_MARGIN / 2)}
    assert choose(with_measurements(estimates, close), None).name == "winograd_f4"
    clear = {"winograd_f4": 100.0, "direct": 100.0 / (1 + 2 * MEASURED_MARGIN)}
    assert choose(with_measurements(estimates, clear), None).name == "direct"


def test_search_times_each_conv_shape_once_and_compile_chooses_by_the_times(tmp_path):
    model, knobs = conv_net(), tmp_path / "knobs.json"
    timings = search_conv_algorithms(model, {"x": (1, 8, 20, 24)}, knobs)
    kernels = chosen_algorithms(model, knobs)
    timed_keys = {key for key, _, records in kernels if len(records) > 1}
    assert {t.key for t in timings} == timed_keys and len(timed_keys) == 2  # not the depthwise conv
    assert [t.convs for t in timings] == [2, 1]
    recorded = json.loads(knobs.read_text())["targets"]
    (entry,) = recorded.values()
    for timing in timings:
        considered = {record["name"] for key, _, records in kernels if key == timing.key
                      for record in records}
        assert set(entry["conv_algorithms"][timing.key]["us"]) == considered == set(timing.measured_us)
        assert all(us > 0 for us in timing.measured_us.values())
        assert entry["conv_algorithms"][timing.key]["shape"] == "x".join(map(str, timing.input_shape))
    assert {t.input_shape for t in timings} == {(1, 8, 20, 24)}
    for key, algorithm, records in kernels:
        timing = next((t for t in timings if t.key == key), None)
        if timing is not None:
            assert algorithm == timing.measured_choice
            assert all("measured_us" in record for record in records)


def test_compile_follows_recorded_times_and_still_matches_onnxruntime(tmp_path):
    """Times that make the slowest-looking candidate win: the choice follows them, whatever the
    cost model says."""
    model, knobs = conv_net(), tmp_path / "knobs.json"
    database = KnobDatabase.open(knobs, resolve_target("host").tvm_target)
    for key, _, records in chosen_algorithms(model, knobs):
        database.record_conv_times(key, {record["name"]: 1.0 if record["name"] == "direct" else 100.0
                                         for record in records}, "1x8x20x24")
    database.save()
    algorithms = [algorithm for _, algorithm, records in chosen_algorithms(model, knobs)
                  if len(records) > 1]
    assert algorithms == ["direct"] * 3
    package = tightfit.compile(model, options=PipelineOptions(knob_database=str(knobs)))
    for shape in [(1, 8, 20, 24), (2, 8, 9, 33)]:
        feeds = {"x": np.random.default_rng(2).standard_normal(shape).astype(np.float32)}
        assert max_abs_error(package.session().run(feeds), run_onnxruntime(model, feeds)) < 1e-4


def test_a_conv1d_is_timed_under_the_key_the_pass_looks_up(tmp_path):
    model, knobs = conv1d_net(), tmp_path / "knobs.json"
    (timing,) = search_conv_algorithms(model, {"x": (2, 12, 40)}, knobs)
    assert timing.input_shape == (2, 12, 40) and "/k1x3/s1x2/" in timing.key
    ((key, algorithm, _),) = chosen_algorithms(model, knobs)
    assert (key, algorithm) == (timing.key, timing.measured_choice)


def test_search_command_writes_knobs_that_compile_uses(tmp_path, capsys):
    model_path, knobs = tmp_path / "conv1d.onnx", tmp_path / "knobs.json"
    model_path.write_bytes(conv1d_net().SerializeToString())
    assert main(["search", str(model_path), "--knobs", str(knobs)]) == 5  # t is dynamic
    assert "--shapes" in capsys.readouterr().err
    assert main(["search", str(model_path), "--target", "emulated-arm64", "--shapes", "x=1,12,64",
                 "--knobs", str(knobs)]) == 5
    assert "only be timed on the device: add --rpc-tracker" in capsys.readouterr().err
    plot = tmp_path / "search.png"
    assert main(["search", str(model_path), "--shapes", "x=1,12,64", "--knobs", str(knobs), "--tiles", "2",
                 "--plot", str(plot), "--json"]) == 0
    (conv,) = json.loads(capsys.readouterr().out)["convs"]
    assert conv["measured_choice"] in conv["measured_us"] and conv["input_shape"] == [1, 12, 64]
    assert set(conv["estimated_at_input_us"]) == set(conv["measured_us"])
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert main(["search", str(model_path), "--shapes", "x=1,12,64", "--knobs", str(knobs), "--tiles", "2"]) == 0
    assert "were in" in capsys.readouterr().out  # the same command again times nothing
    package = tmp_path / "model.tfpkg"
    assert main(["compile", str(model_path), "--knobs", str(knobs), "-o", str(package)]) == 0
    assert main(["run", str(package), "--shape", "x=1,12,50", "--check"]) == 0


def test_a_search_again_takes_what_the_database_holds_and_remeasure_times_it_again(tmp_path):
    """The database is a cache: the same conv key (its dynamic dims `dyn`) is not timed again, at
    another input either, unless a candidate is missing from its record or `remeasure` is set."""
    model, knobs = conv1d_net(), tmp_path / "knobs.json"
    heard = []
    (first,) = search_conv_algorithms(model, {"x": (2, 12, 40)}, knobs, progress=heard.append)
    assert len(heard) == len(first.measured_us) > 1 and not first.measured_before

    heard.clear()
    (again,) = search_conv_algorithms(model, {"x": (1, 12, 64)}, knobs, progress=heard.append)
    assert heard == [] and again.measured_before
    assert again.measured_us == pytest.approx(first.measured_us, abs=1e-3)  # kept to 3 decimals
    assert again.measured_choice == first.measured_choice
    assert again.input_shape == (2, 12, 40)  # where the times were measured

    database = KnobDatabase.open(knobs, resolve_target("host").tvm_target)
    partial = dict(list(first.measured_us.items())[:1])
    database.record_conv_times(first.key, partial, "2x12x40")
    database.save()
    (completed,) = search_conv_algorithms(model, {"x": (1, 12, 64)}, knobs, progress=heard.append)
    assert len(heard) == len(first.measured_us) and not completed.measured_before
    assert set(completed.measured_us) == set(first.measured_us) and completed.input_shape == (1, 12, 64)

    heard.clear()
    (remeasured,) = search_conv_algorithms(model, {"x": (1, 12, 64)}, knobs, progress=heard.append,
                                           remeasure=True)
    assert len(heard) == len(first.measured_us) and not remeasured.measured_before
