"""Ops whose output shape comes from another input's values (Reshape, Expand, Tile, Range,
ConstantOfShape, Slice, TopK, Resize, Upsample), shape arithmetic as exporters write it, and ONNX
types kept through import. Each model is compared with onnxruntime, at several shapes where it is
dynamic, through one compiled package."""

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import tightfit
from tightfit.feeds import run_onnxruntime
from tightfit.frontend import import_onnx
from tightfit.frontend.onnx_rewrites import rewrite_onnx_model

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64


def model(nodes, inputs, outputs, initializers=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def check(onnx_model, *feed_sets):
    """One package, every feed set, each output equal to onnxruntime's in dtype, shape, value."""
    session = tightfit.compile(onnx_model).session()
    for feeds in feed_sets:
        ours = session.run(feeds)
        reference = run_onnxruntime(onnx_model, feeds)
        for name, expected in reference.items():
            assert ours[name].dtype == expected.dtype, name
            assert ours[name].shape == expected.shape, (name, feeds.keys())
            np.testing.assert_allclose(ours[name], expected, rtol=1e-5, atol=1e-6)


def output_shape_is_symbolic(onnx_model) -> bool:
    """Whether main's return type keeps a shape: dims are expressions of the input dims, not
    symbols made up inside the body (which the function boundary erases)."""
    return import_onnx(onnx_model).mod["main"].ret_ty.shape is not None


def value(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def unknown(name, elem, rank):
    """An output whose dims are decided at run time (ONNX still wants its rank declared)."""
    return helper.make_tensor_value_info(name, elem, [f"{name}_{axis}" for axis in range(rank)])


def const(name, array):
    return numpy_helper.from_array(np.asarray(array), name)


def node(op, inputs, outputs, **attributes):
    return helper.make_node(op, inputs, outputs if isinstance(outputs, list) else [outputs], **attributes)


def floats(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# --- Reshape ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("target, allowzero", [
    ([3, 4], 0), ([-1, 2], 0), ([0, -1], 0), ([2, 0, 3], 0), ([12], 0), ([4, 3], 1),
])
def test_reshape_to_a_shape_given_at_run_time(target, allowzero):
    input_shape = [2, 2, 3] if target == [2, 0, 3] else [2, 6]
    m = model([node("Reshape", ["x", "shape"], "y", allowzero=allowzero)],
              [value("x", FLOAT, input_shape), value("shape", INT64, [len(target)])],
              [unknown("y", FLOAT, len(target))])
    check(m, {"x": np.arange(12, dtype=np.float32).reshape(input_shape), "shape": np.array(target)})


def test_reshape_with_allowzero_makes_an_empty_tensor():
    m = model([node("Reshape", ["x", "shape"], "y", allowzero=1)],
              [value("x", FLOAT, [0, 3]), value("shape", INT64, [2])], [unknown("y", FLOAT, 2)])
    check(m, {"x": np.zeros((0, 3), np.float32), "shape": np.array([3, 0])})


def test_one_package_serves_different_run_time_shapes():
    m = model([node("Reshape", ["x", "shape"], "y")],
              [value("x", FLOAT, ["n"]), value("shape", INT64, [2])], [unknown("y", FLOAT, 2)])
    check(m, {"x": np.arange(12, dtype=np.float32), "shape": np.array([3, -1])},
          {"x": np.arange(10, dtype=np.float32), "shape": np.array([-1, 5])})


def test_concat_of_shape_pieces_feeds_a_reshape_symbolically():
    # PyTorch's x.reshape(x.shape[0], -1): Shape -> Slice -> Concat with a constant -> Reshape
    m = model([node("Shape", ["x"], "s"), node("Slice", ["s", "zero", "one"], "batch"),
               node("Concat", ["batch", "minus_one"], "target", axis=0),
               node("Reshape", ["x", "target"], "y")],
              [value("x", FLOAT, ["b", 3, 4])], [value("y", FLOAT, ["b", 12])],
              [const("zero", [0]), const("one", [1]), const("minus_one", [-1])])
    assert output_shape_is_symbolic(m)
    check(m, {"x": floats(5, 3, 4)}, {"x": floats(1, 3, 4)})


def test_reshape_to_shape_arithmetic_on_int64_tensors_keeps_symbolic_dims():
    # The dynamo exporter's head split: Shape(start, end) -> Squeeze -> Div -> Reshape([-1])
    # -> Concat with constants; the small shape pieces arrive as initializers.
    m = model([node("Shape", ["x"], "batch", start=0, end=1), node("Shape", ["x"], "t", start=1, end=2),
               node("Squeeze", ["t"], "t_scalar"), node("Div", ["t_scalar", "two"], "half"),
               node("Reshape", ["half", "minus_one"], "half_vector"),
               node("Concat", ["batch", "half_vector", "two_vector", "sixteen"], "target", axis=0),
               node("Reshape", ["x", "target"], "y", allowzero=1)],
              [value("x", FLOAT, ["b", "t", 16])], [value("y", FLOAT, ["b", "h", 2, 16])],
              [const("two", np.array(2)), const("minus_one", [-1]), const("two_vector", [2]),
               const("sixteen", [16])])
    assert output_shape_is_symbolic(m)
    check(m, {"x": floats(2, 6, 16)}, {"x": floats(3, 10, 16)})


def test_reshape_dims_computed_by_truncating_division_meet_a_strided_conv():
    # ONNX's int Div truncates, a stride-2 conv's length floors: the same number written two
    # ways, which the residual Add must see as one dim.
    m = model([node("Conv", ["x", "w"], "c", strides=[2], pads=[1, 1], kernel_shape=[3]),
               node("Shape", ["x"], "b", start=0, end=1), node("Shape", ["x"], "t", start=2, end=3),
               node("Sub", ["t", "one"], "t1"), node("Div", ["t1", "two"], "q"), node("Add", ["q", "one"], "frames"),
               node("Concat", ["b", "four", "frames"], "target", axis=0),
               node("Reshape", ["c", "target"], "r"), node("Add", ["r", "c"], "y")],
              [value("x", FLOAT, ["b", 4, "t"])], [value("y", FLOAT, ["b", 4, "f"])],
              [numpy_helper.from_array(floats(4, 4, 3), "w"), const("one", [1]), const("two", [2]),
               const("four", [4])])
    assert output_shape_is_symbolic(m)
    check(m, {"x": floats(1, 4, 9)}, {"x": floats(2, 4, 12)})


def test_reshape_of_shape_values_computed_through_reduce_prod():
    m = model([node("Shape", ["x"], "s"), node("ReduceProd", ["s"], "n", keepdims=1),
               node("Reshape", ["x", "n"], "y")],
              [value("x", FLOAT, ["a", "b"])], [value("y", FLOAT, ["n"])])
    check(m, {"x": floats(3, 4)}, {"x": floats(5, 2)})


# --- Expand, Tile, ConstantOfShape, Range -------------------------------------------------------------

@pytest.mark.parametrize("input_shape, target", [
    ((3, 1), [3, 4]), ((3, 1), [1, 6]), ((3, 1), [2, 1, 6]), ((1, 4), [5, 1]),
])
def test_expand_to_a_shape_given_at_run_time_keeps_dims_where_it_says_1(input_shape, target):
    m = model([node("Expand", ["x", "shape"], "y")],
              [value("x", FLOAT, list(input_shape)), value("shape", INT64, [len(target)])],
              [unknown("y", FLOAT, max(len(target), len(input_shape)))])
    check(m, {"x": floats(*input_shape), "shape": np.array(target)})


def test_expand_repeats_a_symbolic_dim_that_is_1_at_run_time():
    m = model([node("Expand", ["x", "shape"], "y")],
              [value("x", FLOAT, ["n", 1]), value("shape", INT64, [2])], [unknown("y", FLOAT, 2)])
    check(m, {"x": floats(1, 1), "shape": np.array([3, 4])},
          {"x": floats(3, 1), "shape": np.array([1, 4])}, {"x": floats(3, 1), "shape": np.array([3, 2])})


def test_expand_to_another_tensors_shape_is_symbolic():
    m = model([node("Shape", ["z"], "s"), node("Expand", ["x", "s"], "y")],
              [value("x", FLOAT, [1, "n"]), value("z", FLOAT, ["m", 1])], [value("y", FLOAT, ["m", "n"])])
    assert output_shape_is_symbolic(m)
    check(m, {"x": floats(1, 4), "z": floats(3, 1)}, {"x": floats(1, 2), "z": floats(5, 1)})


def test_tile_by_repeats_given_at_run_time():
    m = model([node("Tile", ["x", "repeats"], "y")],
              [value("x", FLOAT, [2, 3]), value("repeats", INT64, [2])], [unknown("y", FLOAT, 2)])
    check(m, {"x": floats(2, 3), "repeats": np.array([2, 3])}, {"x": floats(2, 3), "repeats": np.array([1, 2])})


def test_tile_by_a_shape_is_symbolic():
    m = model([node("Shape", ["z"], "repeats"), node("Tile", ["x", "repeats"], "y")],
              [value("x", FLOAT, [2, 3]), value("z", FLOAT, ["p", "q"])], [unknown("y", FLOAT, 2)])
    assert output_shape_is_symbolic(m)
    check(m, {"x": floats(2, 3), "z": floats(2, 3)}, {"x": floats(2, 3), "z": floats(1, 4)})


def test_constant_of_a_computed_shape_adds_to_its_source():
    m = model([node("Shape", ["x"], "s"),
               node("ConstantOfShape", ["s"], "ones", value=numpy_helper.from_array(np.array([1.5], np.float32))),
               node("Add", ["x", "ones"], "y")],
              [value("x", FLOAT, ["a", 3])], [value("y", FLOAT, ["a", 3])])
    assert output_shape_is_symbolic(m)
    check(m, {"x": floats(2, 3)}, {"x": floats(5, 3)})


def test_constant_of_a_shape_given_at_run_time():
    m = model([node("ConstantOfShape", ["s"], "y", value=numpy_helper.from_array(np.array([7], np.int64)))],
              [value("s", INT64, [2])], [unknown("y", INT64, 2)])
    check(m, {"s": np.array([2, 3])}, {"s": np.array([4, 1])})


def test_range_over_a_dim_is_symbolic_and_broadcasts_against_its_source():
    # position ids: Range(0, x.shape[1]) added to every row of x
    m = model([node("Shape", ["x"], "s"), node("Gather", ["s", "one"], "n"),
               node("Range", ["zero", "n", "one"], "positions"),
               node("Cast", ["positions"], "positions_float", to=FLOAT), node("Add", ["x", "positions_float"], "y")],
              [value("x", FLOAT, ["b", "t"])], [value("y", FLOAT, ["b", "t"])],
              [const("one", np.array(1)), const("zero", np.array(0))])
    assert output_shape_is_symbolic(m)
    check(m, {"x": floats(2, 5)}, {"x": floats(3, 7)})


def test_range_with_bounds_given_at_run_time():
    m = model([node("Range", ["start", "limit", "delta"], "r"), node("Mul", ["r", "r"], "y")],
              [value("start", INT64, []), value("limit", INT64, []), value("delta", INT64, [])],
              [unknown("y", INT64, 1)])
    check(m, {"start": np.array(1), "limit": np.array(10), "delta": np.array(2)},
          {"start": np.array(5), "limit": np.array(-3), "delta": np.array(-3)})


# --- Slice, TopK --------------------------------------------------------------------------------------

def test_slice_to_half_of_a_dim_is_symbolic():
    # x[:, : x.shape[1] // 2]
    m = model([node("Shape", ["x"], "s"), node("Gather", ["s", "one"], "n"), node("Div", ["n", "two"], "half"),
               node("Slice", ["x", "zero", "half", "one"], "y")],
              [value("x", FLOAT, ["a", "b"])], [value("y", FLOAT, ["a", "c"])],
              [const("one", [1]), const("two", [2]), const("zero", [0])])
    assert output_shape_is_symbolic(m)
    check(m, {"x": floats(3, 4)}, {"x": floats(2, 7)})


def test_slice_with_bounds_given_at_run_time():
    m = model([node("Slice", ["x", "starts", "ends", "axes", "steps"], "y")],
              [value("x", FLOAT, [4, 6]), value("starts", INT64, [2]), value("ends", INT64, [2]),
               value("axes", INT64, [2]), value("steps", INT64, [2])], [unknown("y", FLOAT, 2)])
    check(m, {"x": floats(4, 6), "starts": np.array([-1, 1]), "ends": np.array([-100, 100]),
              "axes": np.array([0, 1]), "steps": np.array([-2, 2])})


@functools.cache
def runtime_slice_session():
    """Slice of a rank-3 input of symbolic dims along two axes, every bound fed at run time."""
    m = model([node("Slice", ["x", "starts", "ends", "axes", "steps"], "y")],
              [value("x", FLOAT, ["a", "b", "c"]), value("starts", INT64, [2]), value("ends", INT64, [2]),
               value("axes", INT64, [2]), value("steps", INT64, [2])], [unknown("y", FLOAT, 3)])
    return m, tightfit.compile(m).session()


@st.composite
def slice_bounds(draw):
    """(start, end, step) of one axis: small bounds of any sign, or an end of "all the way"
    (INT64_MAX forward, INT64_MIN backward, as exporters write it)."""
    step = draw(st.integers(-3, 3).filter(bool))
    to_the_edge = 2**63 - 1 if step > 0 else -2**63
    return draw(st.integers(-9, 9)), draw(st.integers(-9, 9) | st.just(to_the_edge)), step


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(0, 5), min_size=3, max_size=3),
       axes=st.permutations([0, 1, 2]).map(lambda order: order[:2]), negative_axes=st.booleans(),
       bounds=st.lists(slice_bounds(), min_size=2, max_size=2))
def test_slice_with_bounds_given_at_run_time_matches_onnxruntime(shape, axes, negative_axes, bounds):
    """Bounds of either sign and past either end, steps of either sign, empty dims and empty
    results: one package's gather by clamped start, step and length (ops_shape._slice_by_gather)
    gives onnxruntime's values and shape. (Huge bounds are drawn only as exporters write them:
    onnxruntime and onnx's reference disagree on, e.g., an end of INT64_MAX with a negative step.)"""
    m, session = runtime_slice_session()
    starts, ends, steps = zip(*bounds)
    feeds = {"x": np.arange(np.prod(shape), dtype=np.float32).reshape(shape),
             "starts": np.array(starts, np.int64), "ends": np.array(ends, np.int64),
             "axes": np.array([axis - 3 if negative_axes else axis for axis in axes], np.int64),
             "steps": np.array(steps, np.int64)}
    expected = run_onnxruntime(m, feeds)["y"]
    actual = session.run(feeds)["y"]
    assert actual.shape == expected.shape
    np.testing.assert_array_equal(actual, expected)


@pytest.mark.parametrize("largest", [1, 0])
def test_topk_with_k_given_at_run_time(largest):
    m = model([node("TopK", ["x", "k"], ["values", "indices"], axis=1, largest=largest)],
              [value("x", FLOAT, [3, 10]), value("k", INT64, [1])],
              [unknown("values", FLOAT, 2), unknown("indices", INT64, 2)])
    x = np.random.default_rng(0).permutation(30).reshape(3, 10).astype(np.float32)
    check(m, {"x": x, "k": np.array([4])}, {"x": x, "k": np.array([1])})


def test_topk_with_k_computed_from_a_shape():
    m = model([node("Shape", ["x"], "s"), node("Gather", ["s", "one"], "n"), node("Div", ["n", "two"], "k"),
               node("TopK", ["x", "k"], ["values", "indices"], axis=1)],
              [value("x", FLOAT, ["b", "n"])], [unknown("values", FLOAT, 2), unknown("indices", INT64, 2)],
              [const("one", [1]), const("two", [2])])
    check(m, {"x": floats(2, 8)}, {"x": floats(1, 11)})


# --- Resize, Upsample ---------------------------------------------------------------------------------

def test_resize_to_sizes_given_at_run_time():
    m = model([node("Resize", ["x", "", "", "sizes"], "y", mode="nearest")],
              [value("x", FLOAT, [1, 2, 4, 4]), value("sizes", INT64, [4])], [unknown("y", FLOAT, 4)])
    x = np.arange(32, dtype=np.float32).reshape(1, 2, 4, 4)
    check(m, {"x": x, "sizes": np.array([1, 2, 8, 6])}, {"x": x, "sizes": np.array([1, 2, 3, 5])})


def test_resize_by_scales_given_at_run_time():
    m = model([node("Resize", ["x", "", "scales"], "y", mode="nearest")],
              [value("x", FLOAT, [1, 1, 3, 3]), value("scales", FLOAT, [4])], [unknown("y", FLOAT, 4)])
    check(m, {"x": np.arange(9, dtype=np.float32).reshape(1, 1, 3, 3), "scales": np.array([1, 1, 2, 2], np.float32)})


def test_resize_to_another_maps_size_is_symbolic():
    # F.interpolate(coarse, size=fine.shape[-2:])
    m = model([node("Shape", ["fine"], "s"), node("Slice", ["s", "two", "four"], "hw"),
               node("Shape", ["coarse"], "cs"), node("Slice", ["cs", "zero", "two"], "nc"),
               node("Concat", ["nc", "hw"], "sizes", axis=0),
               node("Resize", ["coarse", "", "", "sizes"], "y", mode="nearest")],
              [value("coarse", FLOAT, [1, 2, "h", "w"]), value("fine", FLOAT, [1, 3, "H", "W"])],
              [value("y", FLOAT, [1, 2, "H", "W"])],
              [const("zero", [0]), const("two", [2]), const("four", [4])])
    assert output_shape_is_symbolic(m)
    check(m, {"coarse": floats(1, 2, 3, 4), "fine": floats(1, 3, 6, 8)},
          {"coarse": floats(1, 2, 5, 2), "fine": floats(1, 3, 10, 3)})


@pytest.mark.parametrize("mode, coordinates", [
    ("linear", "half_pixel"), ("linear", "align_corners"), ("cubic", "half_pixel"),
    ("nearest", "asymmetric"), ("linear", "pytorch_half_pixel"),
])
def test_resize_by_a_scale_that_does_not_divide_the_dim_maps_coordinates_with_the_scale(mode, coordinates):
    # 0.6 * 5 = 3: the output has 3 pixels, but coordinates scale by 1 / 0.6, not by 5 / 3.
    m = model([node("Resize", ["x", "", "scales"], "y", mode=mode, coordinate_transformation_mode=coordinates)],
              [value("x", FLOAT, [1, 1, "h", "w"])], [unknown("y", FLOAT, 4)],
              [const("scales", np.array([1, 1, 0.6, 1.7], np.float32))])
    check(m, {"x": floats(1, 1, 5, 4)}, {"x": floats(1, 1, 7, 3)})


@pytest.mark.parametrize("coordinates", ["half_pixel", "pytorch_half_pixel", "asymmetric",
                                         "align_corners", "tf_half_pixel_for_nn"])
@pytest.mark.parametrize("rounding", ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"])
@pytest.mark.parametrize("dims", [[1, 1, 2, 2], [1, 1, "h", "w"]], ids=["static", "symbolic"])
def test_nearest_resize_to_sizes_at_uneven_ratios_picks_onnxruntimes_pixels(coordinates, rounding, dims):
    """2 -> 7 puts output row 3 exactly half-way (0.5): a multiply-add of TOPI's inverse scale
    landed past it and picked row 1 (onnx's test_resize_upsample_sizes_nearest)."""
    m = model([node("Resize", ["x", "", "", "sizes"], "y", mode="nearest",
                    coordinate_transformation_mode=coordinates, nearest_mode=rounding)],
              [value("x", FLOAT, dims)], [unknown("y", FLOAT, 4)], [const("sizes", [1, 1, 7, 8])])
    x = np.arange(4, dtype=np.float32).reshape(1, 1, 2, 2)
    feeds = [{"x": x}] if dims[2] == 2 else [{"x": x}, {"x": floats(1, 1, 3, 5)}, {"x": floats(1, 1, 5, 3)}]
    check(m, *feeds)


def test_resize_of_a_sequence_to_sizes_given_at_run_time():
    m = model([node("Resize", ["x", "", "", "sizes"], "y", mode="linear")],
              [value("x", FLOAT, [1, 2, 5]), value("sizes", INT64, [3])], [unknown("y", FLOAT, 3)])
    check(m, {"x": floats(1, 2, 5), "sizes": np.array([1, 2, 8])})


def test_resize_of_named_axes_at_opset_18():
    m = model([node("Resize", ["x", "", "scales"], "y", mode="nearest", axes=[3, 2])],
              [value("x", FLOAT, [1, 2, 3, 4])], [unknown("y", FLOAT, 4)],
              [const("scales", np.array([2.0, 3.0], np.float32))], opset=18)
    check(m, {"x": floats(1, 2, 3, 4)})


@pytest.mark.parametrize("scale", [2.0, 0.5])
def test_resize_in_its_opset_10_form(scale):
    m = model([node("Resize", ["x", "scales"], "y", mode="nearest")],
              [value("x", FLOAT, [1, 1, 4, 6])], [unknown("y", FLOAT, 4)],
              [const("scales", np.array([1, 1, scale, scale], np.float32))], opset=10)
    check(m, {"x": floats(1, 1, 4, 6)})


def test_upsample_scales_are_an_input_at_opset_9_and_dims_may_be_symbolic():
    m = model([node("Upsample", ["x", "scales"], "y", mode="linear")],
              [value("x", FLOAT, [1, 1, "h", "w"])], [unknown("y", FLOAT, 4)],
              [const("scales", np.array([1, 1, 2, 3], np.float32))], opset=9)
    check(m, {"x": floats(1, 1, 2, 2)}, {"x": floats(1, 1, 3, 4)})


def test_upsample_scales_are_an_attribute_at_opset_7():
    m = model([node("Upsample", ["x"], "y", mode="nearest", scales=[1.0, 1.0, 2.0, 2.0])],
              [value("x", FLOAT, [1, 1, 2, 3])], [unknown("y", FLOAT, 4)], opset=7)
    check(m, {"x": floats(1, 1, 2, 3)})


# --- types and the ONNX-level rewrite ----------------------------------------------------------------

def test_float64_scalar_from_shape_arithmetic_meets_float32():
    # PyTorch's attention scale: Shape -> Gather -> Cast(float) -> Pow(0.5) -> Div
    m = model([node("Shape", ["x"], "s"), node("Gather", ["s", "last"], "d"),
               node("Cast", ["d"], "df", to=FLOAT), node("Pow", ["df", "half"], "scale"),
               node("Div", ["x", "scale"], "y")],
              [value("x", FLOAT, ["b", 16])], [value("y", FLOAT, ["b", 16])],
              [const("last", np.array(1)), const("half", np.array(0.5, np.float32))])
    check(m, {"x": floats(3, 16)}, {"x": floats(1, 16)})


def test_outputs_keep_the_onnx_index_type():
    m = model([node("ArgMax", ["x"], "i", axis=1)], [value("x", FLOAT, [2, 5])], [value("i", INT64, [2, 1])])
    check(m, {"x": floats(2, 5)})


def test_small_initializers_become_constants_but_overridable_and_large_ones_stay():
    m = model([node("Add", ["x", "small"], "a"), node("Add", ["a", "large"], "b"), node("Add", ["b", "default"], "y")],
              [value("x", FLOAT, [100]), value("default", FLOAT, [100])], [value("y", FLOAT, [100])],
              [numpy_helper.from_array(np.ones(1, np.float32), "small"),
               numpy_helper.from_array(np.ones(100, np.float32), "large"),
               numpy_helper.from_array(np.ones(1, np.float32), "default")])
    rewritten = rewrite_onnx_model(m)
    assert sorted(init.name for init in rewritten.graph.initializer) == ["default", "large"]
    assert [n.output[0] for n in rewritten.graph.node if n.op_type == "Constant"] == ["small"]
    assert len(m.graph.initializer) == 3  # the caller's model is not changed
