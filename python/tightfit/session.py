"""Running a compiled package: input checks, the Relax VM, outputs as numpy.

On the host, or on a device over RPC (`Package.remote_session`): then the VM, the library and
the weights live on the device and only inputs and outputs cross the connection.

One session serves every input shape the model's symbolic dims allow, with no recompilation.
Inputs are checked against the ONNX declaration before anything runs, so a wrong name, rank, dim
or dtype is an InputError that says what the model expects. Inputs that fit their declarations
but not the graph (a size its strides do not divide evenly) fail a shape check inside the model
while it runs, which is an InputError too, naming the inputs and the two dims that disagree.

On the host, arrays cross into and out of the VM without copies where that is safe: an input
that TVM can view (contiguous and writable, at any address: the kernels assume no more than
element alignment, kernel_lowering.py) is passed as a view, any other is copied into a buffer
the session keeps for that input; an output the compiled code
allocates anew on every run (`Package.fresh_outputs`) is handed back as a numpy view of that
allocation, any other (an input, a weight or a constant returned as it is) is copied. TVM's
own conversions cost ~11 us per input and ~5 us per output, more than some whole models take.
"""

from __future__ import annotations

import re

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from .errors import InputError, TargetError
from .frontend import TensorSpec
from .frontend.ops_gather import INDEX_ERROR_FUNCTION


class Session:
    """Runs one package; create it with `Package.session()`."""

    def __init__(self, package, device: tvm.runtime.Device | None = None, executable=None,
                 remote=None):
        executable = executable or package.executable
        if executable is None:
            raise TargetError(f"this package is compiled for {package.target['name']}, not for this machine: "
                              "run it there, e.g. `tightfit run PACKAGE --rpc-tracker HOST:PORT --rpc-key KEY` "
                              "or Package.remote_session(tracker, key)")
        self.package = package
        self.device = device or tvm.cpu()
        self.remote = remote  # the RPC session, kept open as long as this session lives
        self.executable = executable
        self._vm = relax.VirtualMachine(executable, self.device)
        self._main = self._vm["main"]
        self._input_names = [spec.name for spec in package.inputs]
        # a property building the list took 0.5 us of a 9 us run
        self._output_names = [spec.name for spec in package.outputs]
        self.weights = [device_tensor(weight.value, self.device) for weight in package.weights]
        self._on_host = remote is None and _is_host(self.device)
        # a result tuple from a device is a handle to an array there, read through its functions
        self._array_functions = (_ARRAY_FUNCTIONS if remote is None else tuple(
            remote.rpc_session.get_function(name) for name in ARRAY_FUNCTION_NAMES))
        handed_out = {spec.name for spec, fresh in zip(package.outputs, package.fresh_outputs)
                      if fresh and _numpy_exchanges(spec.dtype) and self._on_host}
        # each output's name and how its tensor becomes numpy: a view of a tensor allocated for
        # this run alone, a copy of any other
        self._hand_back = [(name, np.from_dlpack if name in handed_out else tvm.runtime.Tensor.numpy)
                           for name in self._output_names]
        # input name -> (numpy buffer, TVM view of it), for inputs TVM cannot view
        self._staging: dict[str, tuple[np.ndarray, tvm.runtime.Tensor]] = {}
        # input name -> (the array last fed, its shape, strides and dtype then, the tensor the
        # VM got for it, the staging buffer it was copied into or None for a view of it)
        self._placed: dict[str, tuple[np.ndarray, tuple, tuple, np.dtype, tvm.runtime.Tensor,
                                      np.ndarray | None]] = {}
        # the names, dtypes and shapes of the last feeds that passed check_feeds
        self._checked_feeds: tuple | None = None
        # the inputs placed for the last run on the host, each (name, array, its shape, strides
        # and dtype); (staging buffer, array) for those copied; and the VM arguments they made
        self._last_run: tuple[list[tuple], list[tuple], list[tvm.runtime.Tensor]] | None = None
        self._tuple_of_outputs = False  # see _output_tensors

    @property
    def input_names(self) -> list[str]:
        return list(self._input_names)

    @property
    def output_names(self) -> list[str]:
        return list(self._output_names)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the model; returns the outputs by ONNX output name, in the graph's order."""
        arguments = self._arguments_of_last_run(feeds)
        if arguments is None:
            arguments = [*self.prepare_inputs(feeds), *self.weights]
        try:
            result = self._main(*arguments)
        except RuntimeError as err:
            inner = _inner_shape_error(err, feeds)
            if inner is None:
                raise
            raise inner from err
        if type(result) is tvm.runtime.Tensor:  # the one output (0.35 us of a 2.6 us run)
            (name, hand_back), = self._hand_back
            return {name: hand_back(result)}
        if self._tuple_of_outputs:  # see _output_tensors
            return {name: hand_back(_ARRAY_GET_ITEM(result, index))
                    for index, (name, hand_back) in enumerate(self._hand_back)}
        return {name: hand_back(value)
                for (name, hand_back), value in zip(self._hand_back, self._output_tensors(result))}

    def _arguments_of_last_run(self, feeds: dict[str, np.ndarray]) -> list | None:
        """The VM arguments (inputs, then weights) of the last run on the host, if `feeds` are
        its very arrays with their shapes, strides and dtypes unchanged (all settable in place):
        they were checked together then, and a staged one is copied into its buffer again.
        Else None. One pass over the inputs instead of placing each again took a 2.4 us run
        to 2.1 us (gated_skip_block), 4.1 to 3.6 us with two inputs (nonzero_gather)."""
        last_run = self._last_run
        if last_run is None or len(feeds) != len(last_run[0]):
            return None
        placements, staged, arguments = last_run
        for name, array, shape, strides, dtype in placements:
            fed = feeds.get(name)
            if fed is not array or fed.shape != shape or fed.strides != strides or fed.dtype != dtype:
                return None
        for staging, array in staged:
            staging[...] = array  # 0.14 us for a small array, np.copyto 0.26
        return arguments

    def _output_tensors(self, result) -> list[tvm.runtime.Tensor]:
        """The tensors of a result that is not one tensor. The result's structure is the compiled
        function's return type, the same in every run: once a host result has been a tuple of
        exactly the outputs' tensors, `run` reads later ones itself, item by item, without
        asking the tuple's length and each item's type (an FFI call and a check per output)
        and without a list of them between (nonzero_rows_tied, two outputs: 5.1 -> 4.6 us a
        run against reading them through this method)."""
        values = _flatten(result, self._array_functions)
        self._tuple_of_outputs = (self._on_host and isinstance(result, tvm_ffi.Array)
                                  and all(isinstance(item, tvm.runtime.Tensor) for item in result))
        return values

    def prepare_inputs(self, feeds: dict[str, np.ndarray]) -> list[tvm.runtime.Tensor]:
        """Check `feeds` against the model's inputs and place them on the device. Feeds with
        the names, dtypes and shapes of the last checked ones pass without the full check
        (1.7 us of a 10 us model's run), and the very arrays of the last run without any."""
        again = self._arguments_of_last_run(feeds)
        if again is not None:
            return again[:len(self._input_names)]
        signature = _feed_signature(feeds)
        if signature is None or signature != self._checked_feeds:
            check_feeds(self.package.inputs, feeds)
            self._checked_feeds = signature
        if not self._on_host:
            return [tvm.runtime.tensor(np.asarray(feeds[name], order="C"), self.device)
                    for name in self._input_names]
        tensors = [self._host_input(name, feeds[name]) for name in self._input_names]
        placed = [self._placed.get(name) for name in self._input_names]
        # every input placed now (not an empty one, or one of a type TVM converts itself)
        if all(place is not None and place[0] is feeds[name]
               for name, place in zip(self._input_names, placed)):
            self._last_run = ([(name, array, shape, strides, dtype)
                               for name, (array, shape, strides, dtype, _, _)
                               in zip(self._input_names, placed)],
                              [(staging, array) for array, _, _, _, _, staging in placed
                               if staging is not None],
                              [*tensors, *self.weights])
        else:
            self._last_run = None
        return tensors

    def _host_input(self, name: str, array: np.ndarray) -> tvm.runtime.Tensor:
        """A view of `array` when TVM can take one, else a copy into this session's buffer
        for that input, kept while the input's shape stays: a new buffer per run cost
        ~3 us of a run. (A Session, like TVM's VM, runs one call at a time.)

        The array fed last under a name is placed as it was last time while its shape,
        strides and dtype (all settable in place) are unchanged: through the same view, or
        copied into the same buffer, without checking it again (reading an array's flags
        and address cost ~1.5 us, taking a view ~1 us; a 10 us model's run). A view reads
        the array's memory, so values written into it since are what the run sees."""
        again = self._placed_again(name, array)
        if again is not None:
            return again
        if array.size == 0 or array.dtype not in NUMPY_DLPACK_DTYPES:
            return tvm.runtime.tensor(np.asarray(array, order="C"), tvm.cpu())
        if _viewable(array):
            tensor, buffer = _view(array), None
        else:
            staged = self._staging.get(name)
            if staged is None or staged[0].shape != array.shape or staged[0].dtype != array.dtype:
                staged_buffer = np.empty(array.shape, array.dtype)
                staged = self._staging[name] = (staged_buffer, _view(staged_buffer))
            buffer, tensor = staged
            np.copyto(buffer, array)
        self._placed[name] = (array, array.shape, array.strides, array.dtype, tensor, buffer)
        return tensor

    def _placed_again(self, name: str, array) -> tvm.runtime.Tensor | None:
        """The tensor `array` got when it was last fed under `name` (copied again into its
        staging buffer), if it is that array with the same shape, strides and dtype; else
        None."""
        placed = self._placed.get(name)
        if (placed is None or placed[0] is not array or placed[1] != array.shape
                or placed[2] != array.strides or placed[3] != array.dtype):
            return None
        if placed[5] is not None:
            placed[5][...] = array  # 0.14 us for a small array, np.copyto 0.26
        return placed[4]

    def profile(self, feeds: dict[str, np.ndarray]):
        """Each kernel's time in a run on `feeds`, and the whole run's (profiling.py)."""
        from .profiling import profile_kernels

        return profile_kernels(self, feeds)

    def time_run(self, feeds: dict[str, np.ndarray], number: int = 1, repeat: int = 20,
                 min_repeat_ms: int = 0) -> list[float]:
        """Seconds per run for `repeat` measurements, timed inside the VM (no Python overhead)."""
        arguments = self.prepare_inputs(feeds)
        self._vm.set_input("main", *arguments, *self.weights)
        self._vm.invoke_stateful("main")  # warm-up: first-touch of memory and code pages
        timer = self._vm.time_evaluator("invoke_stateful", self.device, number=number,
                                        repeat=repeat, min_repeat_ms=min_repeat_ms)
        return list(timer("main").results)


def device_tensor(array: np.ndarray, device: tvm.runtime.Device) -> tvm.runtime.Tensor:
    """A TVM tensor for `array`: a view of the same memory when TVM can take it (host device,
    writable, contiguous — mapped weights are), a copy otherwise."""
    if _is_host(device) and _viewable(array):
        return _view(array)
    return tvm.runtime.tensor(np.asarray(array, order="C"), device)


def _view(array: np.ndarray) -> tvm.runtime.Tensor:
    """A TVM tensor of `array`'s memory, at whatever address it is: tightfit's kernels assume
    element alignment only (kernel_lowering.py), where `tvm.runtime.from_dlpack` insists on the
    64 bytes TVM's own kernels assume."""
    return tvm_ffi.from_dlpack(array, require_alignment=0, require_contiguous=True)

# element types numpy exchanges over DLPack (not bfloat16 or the float8 types, which TVM's own
# conversion handles through ml_dtypes)
NUMPY_DLPACK_DTYPES = frozenset(np.dtype(name) for name in (
    "bool", "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
    "uint32", "uint64", "complex64", "complex128"))


def _viewable(array: np.ndarray) -> bool:
    return (array.flags.c_contiguous and array.flags.writeable and array.size > 0
            and array.dtype in NUMPY_DLPACK_DTYPES)


def _numpy_exchanges(dtype_name: str) -> bool:
    try:
        return np.dtype(dtype_name) in NUMPY_DLPACK_DTYPES
    except TypeError:  # a type numpy does not know (bfloat16 without ml_dtypes)
        return False


def _is_host(device: tvm.runtime.Device) -> bool:
    return device.dlpack_device_type() == tvm.cpu().dlpack_device_type()


def check_feeds(specs: list[TensorSpec], feeds: dict[str, np.ndarray]) -> None:
    """Raise InputError unless `feeds` has exactly the declared inputs with fitting shapes."""
    expected = [spec.name for spec in specs]
    missing = [name for name in expected if name not in feeds]
    unknown = [name for name in feeds if name not in expected]
    if missing or unknown:
        raise InputError(f"the model takes inputs {expected}; missing {missing}, unknown {unknown}")
    symbol_values: dict[str, tuple[int, str]] = {}
    for spec in specs:
        value = feeds[spec.name]
        if not isinstance(value, np.ndarray):
            raise InputError(f"input {spec.name} must be a numpy array, got {type(value).__name__}")
        if value.dtype != spec.dtype:
            raise InputError(f"input {spec.name} must be {spec.dtype}, got {value.dtype}; "
                             f"convert it with .astype(np.{spec.dtype})")
        if spec.shape is None:
            continue
        if value.ndim != len(spec.shape):
            raise InputError(f"input {spec.name} must have rank {len(spec.shape)} "
                             f"(shape {_show(spec.shape)}), got shape {value.shape}")
        for axis, (declared, actual) in enumerate(zip(spec.shape, value.shape)):
            if isinstance(declared, int):
                if declared != actual:
                    raise InputError(f"input {spec.name} must have shape {_show(spec.shape)}, got "
                                     f"{value.shape} (axis {axis} is fixed at {declared})")
                continue
            seen = symbol_values.setdefault(declared, (actual, f"{spec.name} axis {axis}"))
            if seen[0] != actual:
                raise InputError(f"dim {declared} is {seen[0]} at {seen[1]} but {actual} at "
                                 f"{spec.name} axis {axis}; the model needs them equal")


# What TVM's VM raises when a dim computed inside the model disagrees with one bound earlier
# (the shape checks that RDP's Merge and the importer leave in the graph); the groups are the
# value, the one expected, the tensor's annotated type and the axis
_INNER_SHAPE_CHECK = re.compile(r"\((-?\d+) vs\. (-?\d+)\) : ErrorContext\(match_cast, ty=(.*)\)"
                                r"\s+match_cast error,\s+shape\[(\d+)\] mismatch")


def _inner_shape_error(err: RuntimeError, feeds: dict[str, np.ndarray]) -> InputError | None:
    """An InputError for a failed shape check inside the model, saying which inputs did it;
    None for any other error. The inputs passed check_feeds: each fits its declaration, but
    together they are shapes (or, where a dim depends on data, values) the graph cannot run."""
    found = _INNER_SHAPE_CHECK.search(str(err))
    if found is None:
        return None
    value, expected, annotation, axis = found.groups()
    inputs = ", ".join(f"{name} {'x'.join(map(str, array.shape))}" for name, array in feeds.items())
    return InputError(
        f"the model cannot run on these inputs ({inputs}): inside it, axis {axis} of a tensor is "
        f"{value} where the graph needs {expected} (checked against {annotation}). The input "
        "shapes do not fit the model, often a size its strides or reshapes do not divide evenly, "
        "or, where a dim depends on the input values, the values do not")


def _feed_signature(feeds: dict) -> tuple | None:
    """(name, dtype, shape) of each feed, in order; None if one is not a numpy array."""
    if not all(type(value) is np.ndarray for value in feeds.values()):
        return None
    return tuple((name, value.dtype, value.shape) for name, value in feeds.items())


ARRAY_FUNCTION_NAMES = ("ffi.ArraySize", "ffi.ArrayGetItem")
_ARRAY_FUNCTIONS = tuple(tvm_ffi.get_global_func(name) for name in ARRAY_FUNCTION_NAMES)
_ARRAY_GET_ITEM = _ARRAY_FUNCTIONS[1]


def _flatten(result, array_functions: tuple = _ARRAY_FUNCTIONS) -> list[tvm.runtime.Tensor]:
    """The tensors of a VM result (a tensor, a shape value as an int64 tensor, or a tuple of
    them, nested), in order, a tuple read with `array_functions` (ARRAY_FUNCTION_NAMES: a device's own for a result there, a
    handle to an array on it). A tuple is an FFI array whose iteration asks its length again for
    every element: two FFI calls, ~2.7 us per output; one call per element instead."""
    if isinstance(result, tvm.runtime.Tensor):
        return [result]
    if isinstance(result, tvm_ffi.Shape):  # ONNX Shape's value as an output: no tensor of its own
        return [tvm.runtime.tensor(np.array(result, dtype=np.int64))]
    array_size, array_get_item = array_functions
    values = []
    for index in range(array_size(result)):
        item = array_get_item(result, index)
        if isinstance(item, tvm.runtime.Tensor):
            values.append(item)
        else:
            values.extend(_flatten(item, array_functions))
    return values



@tvm_ffi.register_global_func(INDEX_ERROR_FUNCTION)
def _index_out_of_range(index: int, extent: int, where: str) -> None:
    """What a compiled model calls on an index outside the dim it is into (ops_gather.py)."""
    raise InputError(f"{where}: index {index} is out of range for a dim of {extent} (valid: "
                     f"{-extent} to {extent - 1}); check the input it comes from (a token id "
                     "past the vocabulary, a class id past the classes)")


# so that the InputError above reaches the caller as itself, through the kernel and the VM
tvm_ffi.register_error("InputError", InputError)


def _show(shape) -> str:
    return "(" + ", ".join(str(dim) for dim in shape) + ")"
