"""strided_view (passes/strided_views.py): a tensor reached by layout ops is found in the tensor
they start from at offset + sum(index x stride), checked against numpy running the same ops."""

from __future__ import annotations

import numpy as np
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st
from tvm import relax, tirx

from tightfit.passes.strided_views import strided_view


def layout_chains():
    """(source shape, [(op, parameters)]) for chains of up to five layout ops."""
    return st.tuples(st.lists(st.integers(1, 4), min_size=1, max_size=4),
                     st.lists(st.tuples(st.sampled_from(["reshape", "permute", "slice", "take",
                                                         "split", "expand_dims"]),
                                        st.randoms(use_true_random=False)),
                              max_size=5))


def apply_chain(source_shape, steps):
    """The Relax function binding each step's result, the numpy value of every tensor, and
    whether every step is an op that always folds (all but a reshape, which may merge axes
    whose elements are not evenly spaced)."""
    builder = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(source_shape, "float32"))
    values = {}
    array = np.arange(int(np.prod(source_shape)), dtype=np.float32).reshape(source_shape)
    always_folds = True
    with builder.function("main", [x]):
        with builder.dataflow():
            tensor = x
            values[x] = array
            for op, rng in steps:
                call, array, folds = _step(op, rng, tensor, array)
                if call is None:
                    continue
                always_folds &= folds
                tensor = builder.emit(call)
                values[tensor] = array
            out = builder.emit_output(tensor)
        builder.emit_func_output(out)
    return builder.get()["main"], values, tensor, always_folds


def _step(op, rng, tensor, array):
    shape = array.shape
    if op == "reshape":
        new_shape = _regrouped(shape, rng)
        return relax.op.reshape(tensor, new_shape), array.reshape(new_shape), False
    if op == "permute":
        axes = list(range(len(shape)))
        rng.shuffle(axes)
        return relax.op.permute_dims(tensor, axes), array.transpose(axes), True
    if op == "expand_dims":
        axis = rng.randint(0, len(shape))
        return relax.op.expand_dims(tensor, [axis]), np.expand_dims(array, axis), True
    if not shape:
        return None, array, True
    axis = rng.randrange(len(shape))
    extent = shape[axis]
    if op == "take":
        index = rng.randrange(-extent, extent)
        return (relax.op.take(tensor, relax.const(index, "int64"), axis=axis),
                np.take(array, index, axis=axis), True)
    if op == "split":
        sections = [cut for cut in range(1, extent) if rng.random() < 0.5]
        part = rng.randrange(len(sections) + 1)
        return (relax.TupleGetItem(relax.op.split(tensor, sections or 1, axis=axis), part)
                if sections else None, np.split(array, sections, axis=axis)[part], True)
    begin = rng.randrange(extent)
    end = rng.randint(begin + 1, extent)
    step = rng.randint(1, 3)
    index = [slice(None)] * len(shape)
    index[axis] = slice(begin, end, step)
    return (relax.op.strided_slice(tensor, [axis], [begin], [end], [step]), array[tuple(index)],
            True)


def _regrouped(shape, rng):
    """A shape of the same size: the dims' prime factors regrouped in order, ones added."""
    factors = [factor for dim in shape for factor in _prime_factors(dim)]
    new_shape, current = [], 1
    for factor in factors:
        current *= factor
        if rng.random() < 0.5:
            new_shape.append(current)
            current = 1
    new_shape.append(current)
    if rng.random() < 0.3:
        new_shape.insert(rng.randint(0, len(new_shape)), 1)
    return new_shape


def _prime_factors(n):
    factors, divisor = [], 2
    while n > 1:
        while n % divisor == 0:
            factors.append(divisor)
            n //= divisor
        divisor += 1
    return factors


@settings(max_examples=200, deadline=None)
@given(chain=layout_chains())
def test_a_layout_chain_reads_its_elements_where_the_view_says(chain):
    """Any chain of reshape, permute_dims, strided_slice, take, split and expand_dims: the
    view's source is one of the chain's tensors, the chain's first when no reshape is in it,
    and its elements at offset + sum(index x stride) are the chain's result."""
    source_shape, steps = chain
    func, values, last, always_folds = apply_chain(source_shape, steps)
    view = strided_view(last, relax.analysis.get_var2val(func))
    assert view is not None
    source = next(array for var, array in values.items() if var.same_as(view.source))
    if always_folds:
        assert view.source.same_as(func.params[0])
    strides = [int(stride) for stride in view.strides]
    found = np.lib.stride_tricks.as_strided(
        source.ravel()[int(view.offset):], [int(dim) for dim in view.shape],
        [stride * source.itemsize for stride in strides])
    np.testing.assert_array_equal(found, values[last])


def test_heads_split_by_batch_and_heads_merged_are_read_at_symbolic_strides():
    """nn.MultiheadAttention's export: [sequence, batch, 3 x 32] -> [sequence, batch, 3, 32]
    -> take 2 along the 3 -> [sequence, batch x 4, 8] (batch and heads merged, not evenly
    spaced) -> [batch x 4, sequence, 8] -> [batch, 4, sequence, 8]: V's head h of batch b,
    query s, element e at 64 + b x 96 + h x 8 + s x 96 x batch + e."""
    sequence, batch = tirx.Var("sequence", "int64"), tirx.Var("batch", "int64")
    builder = relax.BlockBuilder()
    qkv = relax.Var("qkv", relax.TensorType([sequence, batch, 96], "float32"))
    with builder.function("main", [qkv]):
        with builder.dataflow():
            split = builder.emit(relax.op.reshape(qkv, [sequence, batch, 3, 32]))
            v = builder.emit(relax.op.take(split, relax.const(2, "int64"), axis=2))
            merged = builder.emit(relax.op.reshape(v, [sequence, batch * 4, 8]))
            heads_first = builder.emit(relax.op.permute_dims(merged, [1, 0, 2]))
            out = builder.emit_output(relax.op.reshape(heads_first, [batch, 4, sequence, 8]))
        builder.emit_func_output(out)
    func = builder.get()["main"]
    view = strided_view(func.body.body, relax.analysis.get_var2val(func))
    assert view.source.same_as(qkv)
    analyzer = tvm.sym.Analyzer()
    expected = [96, 8, 96 * batch, 1]
    assert int(view.offset) == 64
    assert all(analyzer.can_prove_equal(stride, want)
               for stride, want in zip(view.strides, expected)), view.strides


def test_a_slice_that_may_be_clamped_is_not_folded():
    """A slice of a symbolic axis from 2 on: the axis may be shorter than 2 at run time, and
    the slice then clamps; the view starts at the slice's result."""
    length = tirx.Var("length", "int64")
    builder = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([length, 4], "float32"))
    with builder.function("main", [x]):
        with builder.dataflow():
            sliced = builder.emit(relax.op.strided_slice(x, [0], [2], [length]))
            out = builder.emit_output(relax.op.permute_dims(sliced, [1, 0]))
        builder.emit_func_output(out)
    func = builder.get()["main"]
    view = strided_view(func.body.body, relax.analysis.get_var2val(func))
    assert not view.source.same_as(x)
