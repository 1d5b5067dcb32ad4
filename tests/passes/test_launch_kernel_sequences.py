"""Kernel sequences run from one TIR function, their intermediates in arenas.

The arena checker is independent of the pass: it reads each sequence function the pipeline made,
gives the symbolic dims values (those it takes and those it reads back from a count), and checks
that every tensor the sequence places in an arena lies inside one storage's slot of that arena,
that slots never overlap and that all lie inside their arena. That
two tensors in one storage are never live at once is the storage plan's property, which
test_share_symbolic_storage checks. A second check lowers each sequence with TVM's own TIR
pipeline and reads how many bytes the arena gets there.
"""

import numpy as np
import onnx
import pytest
import tvm
import tvm_ffi
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper
from tvm import relax, tirx
from tvm.s_tir.analysis import calculate_allocated_bytes

import tightfit
from tightfit.feeds import run_onnxruntime
from tightfit.frontend import import_onnx
from tightfit.passes.launch_kernel_sequences import ARENA_SLOTS_ATTR, kernel_sequences
from tightfit.pipeline import run_pipeline
from tightfit.schedules.isa import MAX_STACK_ALLOCA_BYTES
from tightfit.target import resolve_target
from tightfit.testing import zoo
from tightfit.vm_code import interpreted

LOWERED = "tightfit.LaunchKernelSequences"


def _mlp_with_a_hidden_output() -> onnx.ModelProto:
    """x[n, 16] -> MatMul -> Relu (also an output) -> MatMul -> Softmax -> MatMul -> Add x:
    kernels whose intermediates the caller never sees, and one result it does."""
    rng = np.random.default_rng(0)
    weights = [helper.make_tensor(name, TensorProto.FLOAT, shape,
                                  rng.standard_normal(shape).astype("float32").ravel())
               for name, shape in (("w1", (16, 32)), ("w2", (32, 24)), ("w3", (24, 16)))]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]),
             helper.make_node("Relu", ["h"], ["hidden"]),
             helper.make_node("MatMul", ["hidden", "w2"], ["logits"]),
             helper.make_node("Softmax", ["logits"], ["weights"]),
             helper.make_node("MatMul", ["weights", "w3"], ["o"]),
             helper.make_node("Add", ["o", "x"], ["y"])]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 16]),
         helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["n", 32])], initializer=weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _lowered(model: onnx.ModelProto) -> tvm.IRModule:
    mod, _ = run_pipeline(import_onnx(model).mod, resolve_target("host"), stop_after=LOWERED)
    return mod


def _calls(seq: relax.SeqExpr) -> list[str]:
    """The functions of the module that `seq` calls, in order, branches included."""
    names = []
    for block in seq.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.If):
                names += _calls(value.true_branch) + _calls(value.false_branch)
            elif isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.GlobalVar):
                names.append(value.op.name_hint)
    return names


def _kernels_called(sequence: tirx.PrimFunc) -> list[str]:
    return [statement.value.args[0].value for statement in _calls_of(sequence)]


def _calls_of(sequence: tirx.PrimFunc) -> list[tirx.Evaluate]:
    return [statement for statement in sequence.body.seq if isinstance(statement, tirx.Evaluate)]


def _arena(sequence: tirx.PrimFunc) -> tirx.Buffer | None:
    """The arena the sequence allocates as it starts, if it has one."""
    return next((statement.buffer for statement in sequence.body.seq
                 if isinstance(statement, tirx.AllocBuffer)), None)


def _read_back_dims(sequence: tirx.PrimFunc) -> list[tirx.Var]:
    """The dims the sequence binds to a count it reads from a tensor."""
    return [statement.var for statement in sequence.body.seq if isinstance(statement, tirx.Bind)
            and isinstance(statement.value, tvm.ir.expr.TensorLoad)]


def _arenas(sequence: tirx.PrimFunc) -> list[tuple | None]:
    """(data pointer, bytes) of each arena, in the order of the sequence's slot lists: the one
    allocated as it starts, then one taken from the workspace pool after each count read back
    (None where an arena has no slots)."""
    first = _arena(sequence)
    arenas = [(first.data, first.ty.shape[0]) if first is not None else None]
    taken = {statement.var: statement.value.args[2] for statement in sequence.body.seq
             if isinstance(statement, tirx.Bind) and isinstance(statement.value, tvm.ir.Call)
             and statement.value.op.name == "tirx.TVMBackendAllocWorkspace"}
    later_slots = sequence.attrs[ARENA_SLOTS_ATTR][1:]
    pointers = iter(taken.items())
    arenas += [next(pointers) if slots else None for slots in later_slots]
    return arenas


def arena_violations(sequence: tirx.PrimFunc, dim_value) -> list[str]:
    """What is wrong with the arenas of `sequence` when each of its scalar params and read-back
    dims d is dim_value(d)."""
    analyzer = _analyzer_with_dims(sequence, dim_value)
    problems = []
    arenas = _arenas(sequence)
    slots_by_pointer = {}
    for arena, slot_list in zip(arenas, sequence.attrs[ARENA_SLOTS_ATTR]):
        slots = sorted((int(analyzer.simplify(offset)), int(analyzer.simplify(size)))
                       for offset, size in slot_list)
        if arena is None:
            assert not slots
            continue
        arena_bytes = int(analyzer.simplify(arena[1]))
        for (offset, size), (next_offset, _) in zip(slots, slots[1:]):
            if offset + size > next_offset:
                problems.append(f"slot at {offset} of {size} bytes runs into the slot at {next_offset}")
        if slots and slots[-1][0] + slots[-1][1] > arena_bytes:
            problems.append(f"the last slot ends past the arena's {arena_bytes} bytes")
        slots_by_pointer[arena[0]] = slots
    for statement in _calls_of(sequence):
        kernel = statement.value.args[0].value
        for argument in statement.value.args[1:]:
            if not (isinstance(argument, tvm.ir.Call) and argument.op.name == "tirx.tvm_stack_make_array"):
                continue
            data, shape = argument.args[0], argument.args[1]
            if not (isinstance(data, tvm.ir.Call) and data.op.name == "tirx.handle_add_byte_offset"):
                continue  # a view of a tensor passed in
            slots = next((slots for pointer, slots in slots_by_pointer.items()
                          if tvm_ffi.structural_equal(data.args[0], pointer)), None)
            if slots is None:
                problems.append(f"{kernel}: a pointer into no arena")
                continue
            start = int(analyzer.simplify(data.args[1]))
            nbytes = int(np.prod([int(analyzer.simplify(dim)) for dim in shape.args]))
            nbytes *= tvm.runtime.DataType(str(argument.args[4].ty)).bits // 8
            if not any(offset <= start and start + nbytes <= offset + size for offset, size in slots):
                problems.append(f"{kernel}: bytes {start}..{start + nbytes} lie in no one slot")
    return problems


def test_a_chain_of_kernels_runs_from_one_function_with_what_the_caller_sees_passed_in():
    mod = _lowered(_mlp_with_a_hidden_output())
    relax.analysis.well_formed(mod)  # raises unless typed, with no var defined in two functions
    sequences = kernel_sequences(mod)
    assert len(sequences) == 1
    (name, sequence), = sequences.items()
    kernels = _kernels_called(sequence)
    # the VM calls only the sequence; the profiler's copy still calls every kernel itself
    assert _calls(mod["main"].body) == [name]
    assert _calls(mod[interpreted("main")].body) == kernels
    assert len(kernels) >= 3
    # both outputs are the caller's tensors: allocated by the VM and passed in, not in the arena,
    # which the sequence allocates itself
    assert _arena(sequence) is not None
    buffers = [param for param in sequence.params if not isinstance(param.ty, tvm.ir.PrimType)]
    passed_shapes = [[dim.name if isinstance(dim, tirx.Var) else int(dim) for dim in param.ty.shape]
                     for param in buffers]
    assert ["n", 32] in passed_shapes and ["n", 16] in passed_shapes
    assert len(sequence.attrs[ARENA_SLOTS_ATTR][0]) >= 1
    assert arena_violations(sequence, lambda dim: 7) == []


def test_a_small_arena_of_fixed_size_is_never_a_stack_array():
    """At 1 row the MLP's slots end under 1 KiB. TVM would make an arena that small a stack
    array, which was not 64-byte aligned, while the kernels LLVM inlines into the sequence store
    whole 64-byte vectors into it: a run crashed or not depending on where the stack sat."""
    model = _mlp_with_a_hidden_output()
    mod, _ = run_pipeline(import_onnx(model, input_shapes={"x": [1, 16]}).mod,
                          resolve_target("host"), stop_after=LOWERED)
    (sequence,) = kernel_sequences(mod).values()
    starts, sizes = _slots_at(sequence, lambda dim: 1)
    assert max(start + size for start, size in zip(starts, sizes)) < MAX_STACK_ALLOCA_BYTES
    assert int(_arena(sequence).ty.shape[0]) >= MAX_STACK_ALLOCA_BYTES
    assert arena_violations(sequence, lambda dim: 1) == []
    session = tightfit.compile(model, input_shapes={"x": [1, 16]}).session()
    feeds = {"x": np.random.default_rng(3).standard_normal((1, 16)).astype("float32")}
    for name, want in run_onnxruntime(model, feeds).items():
        np.testing.assert_allclose(session.run(feeds)[name], want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def mlp_session():
    model = _mlp_with_a_hidden_output()
    return model, tightfit.compile(model).session()


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_a_lowered_sequence_matches_onnxruntime_at_any_batch(mlp_session, rows):
    model, session = mlp_session
    feeds = {"x": np.random.default_rng(rows).standard_normal((rows, 16)).astype("float32")}
    expected = run_onnxruntime(model, feeds)
    for name, got in session.run(feeds).items():
        np.testing.assert_allclose(got, expected[name], rtol=1e-5, atol=1e-5)


def _split_then_multiply() -> onnx.ModelProto:
    """x[n, 6] -> Exp -> Split into three [n, 2] -> the first two multiplied -> Relu; the third is
    an output too: a tuple of tensors between two kernels, as TorchScript's exporter splits a
    transformer's q, k and v."""
    nodes = [helper.make_node("Exp", ["x"], ["e"]),
             helper.make_node("Split", ["e"], ["a", "b", "c"], axis=1, num_outputs=3),
             helper.make_node("Mul", ["a", "b"], ["m"]),
             helper.make_node("Relu", ["m"], ["y"])]
    graph = helper.make_graph(
        nodes, "split", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2]),
         helper.make_tensor_value_info("c", TensorProto.FLOAT, ["n", 2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_a_tuple_of_tensors_between_kernels_stays_inside_the_sequence():
    """The Split's tuple and the items taken of it are views of its tensors: the kernels on
    either side run in one sequence (transformer_encoder, exported by TorchScript, ran in three
    with two kernels left to the VM), and the item the caller sees is its tensor, passed in."""
    model = _split_then_multiply()
    mod = _lowered(model)
    relax.analysis.well_formed(mod)
    (name, sequence), = kernel_sequences(mod).items()
    assert _calls(mod["main"].body) == [name]
    assert len(_kernels_called(sequence)) == len(_calls(mod[interpreted("main")].body)) == 2
    assert arena_violations(sequence, lambda dim: 5) == []
    session = tightfit.compile(model).session()
    for rows in (1, 5, 33):
        feeds = {"x": np.random.default_rng(rows).standard_normal((rows, 6)).astype("float32")}
        for output, want in run_onnxruntime(model, feeds).items():
            np.testing.assert_allclose(session.run(feeds)[output], want, rtol=1e-5, atol=1e-6)
    transformer = _lowered(zoo.get("transformer_encoder").build())
    assert len(kernel_sequences(transformer)) == 1
    assert all(not isinstance(binding.value, (relax.Tuple, relax.TupleGetItem))
               for block in transformer["main"].body.blocks for binding in block.bindings)


def test_one_kernel_alone_is_left_to_the_vm():
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])])
    mod = _lowered(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert kernel_sequences(mod) == {}
    assert interpreted("main") not in [gv.name_hint for gv in mod.functions]


@settings(max_examples=20, deadline=None)
@given(batch=st.integers(1, 64), sequence_length=st.integers(1, 600))
def test_every_arena_tensor_lies_in_its_own_slot_of_the_arena(transformer_sequences, batch, sequence_length):
    dims = {"batch": batch, "sequence": sequence_length}
    for name, sequence in transformer_sequences.items():
        assert arena_violations(sequence, lambda dim: dims[dim.name]) == [], name


@pytest.mark.parametrize("batch, sequence_length", [(1, 5), (3, 200)])
def test_tvm_lowers_each_arena_to_an_allocation_that_holds_every_slot(transformer_sequences, batch,
                                                                      sequence_length):
    """TVM's TIR lowering shrinks an allocation to the part its accesses reach; a sequence that
    took its tensors' addresses as &arena[offset] got an arena from the first slot's first byte
    to the last slot's first byte, and its last kernels wrote past it (glibc aborted the run)."""
    dims = {"batch": batch, "sequence": sequence_length}
    pipeline, _, _ = tvm.tirx.get_tir_pipeline("default")
    host = resolve_target("host").tvm_target
    for name, sequence in transformer_sequences.items():
        fixed = sequence.specialize({param: tirx.IntImm("int64", dims[param.name])
                                     for param in sequence.params if isinstance(param.ty, tvm.ir.PrimType)})
        module = tvm.tirx.transform.BindTarget(host.with_host(host))(
            tvm.IRModule({name: fixed.with_attr("global_symbol", name)}))
        with tvm.transform.PassContext(opt_level=3):
            allocated = calculate_allocated_bytes(pipeline(module)[name])["main"]["global"]
        starts, sizes = _slots_at(sequence, lambda dim: dims[dim.name])
        assert allocated >= max(start + size for start, size in zip(starts, sizes)), name


@pytest.mark.parametrize("batch, sequence_length", [(1, 1024), (4, 256), (16, 64)])
def test_slots_of_whole_pages_begin_at_different_offsets_within_a_page(transformer_sequences, batch,
                                                                        sequence_length):
    """At these dims every slot's size is a multiple of 4 KiB: laid end to end, all would begin
    at the same offset within a page, where a kernel's loads from one wait on its stores to
    another (4 KiB aliasing)."""
    dims = {"batch": batch, "sequence": sequence_length}
    for name, sequence in transformer_sequences.items():
        starts, sizes = _slots_at(sequence, lambda dim: dims[dim.name])
        assert all(size % PAGE == 0 for size in sizes), name
        page_offsets = [start % PAGE for start in starts]
        assert len(set(page_offsets)) == len(page_offsets), (name, page_offsets)
        assert 0 not in page_offsets, (name, "a slot begins where the allocator's pages do")


PAGE = 4096


def _analyzer_with_dims(sequence: tirx.PrimFunc, dim_value) -> tvm.sym.Analyzer:
    """An analyzer that knows each scalar param and read-back dim d of `sequence` as
    dim_value(d)."""
    analyzer = tvm.sym.Analyzer()
    dims = [param for param in sequence.params if isinstance(param.ty, tvm.ir.PrimType)]
    for dim in dims + _read_back_dims(sequence):
        analyzer.bind(dim, tirx.IntImm("int64", dim_value(dim)))
    return analyzer


def _slots_at(sequence: tirx.PrimFunc, dim_value) -> tuple[list[int], list[int]]:
    analyzer = _analyzer_with_dims(sequence, dim_value)
    slots = [(int(analyzer.simplify(offset)), int(analyzer.simplify(size)))
             for offset, size in sequence.attrs[ARENA_SLOTS_ATTR][0]]
    return [start for start, _ in slots], [size for _, size in slots]


@pytest.fixture(scope="module")
def transformer_sequences():
    """A transformer's two layers in one sequence: intermediates of sizes batch x sequence and
    batch x sequence^2 in several storages (so that the checker has slots to check)."""
    sequences = kernel_sequences(_lowered(zoo.get("transformer_encoder_dynamo").build()))
    assert max(len(sequence.attrs[ARENA_SLOTS_ATTR][0]) for sequence in sequences.values()) >= 4
    return sequences


def _gate_with_two_kernels_in_a_branch() -> onnx.ModelProto:
    """If sum(x) > 0: softmax(x) @ w (two kernels fusion cannot join) else -x."""
    def branch(name, nodes, output):
        return helper.make_graph(nodes, name, [],
                                 [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["n", 8])])

    weight = np.random.default_rng(1).standard_normal((8, 8)).astype("float32")
    nodes = [helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
             helper.make_node("Greater", ["total", "zero"], ["positive"]),
             helper.make_node("If", ["positive"], ["y"],
                              then_branch=branch("then", [helper.make_node("Softmax", ["x"], ["p"]),
                                                          helper.make_node("MatMul", ["p", "w"], ["m"])], "m"),
                              else_branch=branch("else", [helper.make_node("Neg", ["x"], ["q"])], "q"))]
    graph = helper.make_graph(
        nodes, "gate", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])],
        [helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0]),
         helper.make_tensor("w", TensorProto.FLOAT, [8, 8], weight.ravel())])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_kernels_inside_branches_are_lowered_too():
    model = _gate_with_two_kernels_in_a_branch()
    mod = _lowered(model)
    sequences = kernel_sequences(mod)
    branch_calls = []
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            if isinstance(binding.value, relax.If):
                branch_calls += _calls(binding.value.true_branch) + _calls(binding.value.false_branch)
    assert any(name in sequences for name in branch_calls)
    session = tightfit.compile(model).session()
    for sign in (1.0, -1.0):  # the softmax branch, then the negation
        feeds = {"x": sign * np.abs(np.random.default_rng(2).standard_normal((5, 8))).astype("float32")}
        np.testing.assert_allclose(session.run(feeds)["y"], run_onnxruntime(model, feeds)["y"],
                                   rtol=1e-5, atol=1e-5)


def test_a_count_read_back_inside_a_sequence_binds_its_dim_there_and_sizes_a_later_arena():
    """nonzero_gather: the positions where x > 0 are counted, the count becomes a dim, and the
    kernels after it (positions, gathers, a GEMM, a sum) work on tensors of that many rows; the
    whole chain runs from one sequence, whose second arena is taken once the count is known."""
    model = zoo.get("nonzero_gather").build()
    mod = _lowered(model)
    relax.analysis.well_formed(mod)
    (name, sequence), = kernel_sequences(mod).items()
    assert _calls(mod["main"].body) == [name]
    (count_dim,) = _read_back_dims(sequence)
    assert count_dim.name == "nonzero_count" and count_dim not in list(sequence.params)
    first, later = _arenas(sequence)
    assert first is not None and later is not None
    # the later arena's slots are sized by the count, the first one's are not
    assert all(count_dim in tirx.analysis.undefined_vars(size, [])
               for _, size in sequence.attrs[ARENA_SLOTS_ATTR][1])
    for rows, count in [(1, 0), (4, 3), (9, 108), (64, 700)]:
        dims = {"rows": rows, "nonzero_count": count}
        assert arena_violations(sequence, lambda dim: dims[dim.name]) == [], (rows, count)

    session = tightfit.compile(model).session()
    table = np.random.default_rng(0).standard_normal((12, 16)).astype(np.float32)
    for rows, density in [(1, 0.0), (4, 0.5), (9, 1.0), (64, 0.9)]:
        x = np.where(np.random.default_rng(rows).random((rows, 12)) < density, 1.0, -1.0).astype(np.float32)
        feeds = {"x": x, "table": table}
        np.testing.assert_allclose(session.run(feeds)["summary"], run_onnxruntime(model, feeds)["summary"],
                                   rtol=1e-5, atol=1e-4)


def test_a_count_whose_dim_shapes_an_output_is_read_back_between_two_sequences():
    """nonzero_rows_tied returns a tensor of `count` rows: the VM allocates it before it calls
    the sequence that fills it, when the count must be known already, so the count is read back
    in the VM, between the sequence that counts and the one that uses the count."""
    model = zoo.get("nonzero_rows_tied").build()
    mod = _lowered(model)
    sequences = kernel_sequences(mod)
    assert len(sequences) >= 2
    assert all(_read_back_dims(sequence) == [] for sequence in sequences.values())
    session = tightfit.compile(model).session()
    for rows in (1, 3, 7):
        rng = np.random.default_rng(rows)
        feeds = {"x": rng.standard_normal((rows, 4)).astype("float32"),
                 "v": rng.standard_normal((rows, 8)).astype("float32")}
        expected = run_onnxruntime(model, feeds)
        for output, got in session.run(feeds).items():
            np.testing.assert_allclose(got, expected[output], rtol=1e-5, atol=1e-5, err_msg=output)
