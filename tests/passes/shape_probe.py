"""The ground truth for RDP's soundness tests: every binding's concrete shape, at run time.

`ShapeProbe(mod)` compiles a copy of `mod` in which a packed-function call
`tightfit_test.probe("<binding name>", <value>)` follows every binding of `main`, inside `If`
branches too (the VM's instrument hook only sees kernel arguments, which fusion and in-place
lowering no longer map back to bindings). `run(inputs)` then returns, for each binding the
execution reached, an `Observation`: the shape of a tensor, and the values of a small integer
tensor, a shape value or a scalar — what RDP's value lattice predicts. Bindings in the branch
not taken are simply absent.

The copy is compiled without fusion (probes are impure calls, so `main` loses its dataflow
blocks); shapes and values are properties of the program, not of how it is compiled.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

PROBE_FUNCTION = "tightfit_test.probe"
MAX_RECORDED_VALUES = 16


@dataclass(frozen=True)
class Observation:
    """What one binding held in one run. `shape` is None for a shape value or a scalar;
    `values` holds the elements (row-major) when there are at most MAX_RECORDED_VALUES integers;
    `fields` the observations of a tuple's fields."""

    shape: tuple[int, ...] | None
    values: tuple | None = None
    fields: tuple | None = None


def observe(value) -> Observation:
    if isinstance(value, tvm.runtime.Tensor):
        array = value.numpy()
        small_integers = array.size <= MAX_RECORDED_VALUES and (
            np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_)
        values = tuple(int(v) for v in array.ravel()) if small_integers else None
        return Observation(tuple(int(d) for d in array.shape), values)
    if isinstance(value, tvm_ffi.Shape):
        return Observation(None, tuple(int(v) for v in value))
    if isinstance(value, (bool, int, np.integer)):
        return Observation(None, (int(value),))
    if isinstance(value, float):
        return Observation(None, (value,))
    if isinstance(value, (tvm_ffi.Array, list, tuple)):
        return Observation(None, fields=tuple(observe(field) for field in value))
    return Observation(None)


def with_probes(mod: tvm.IRModule, function: str = "main") -> tvm.IRModule:
    """A copy of `mod` whose `function` reports every binding to PROBE_FUNCTION.

    Probes are impure, so dataflow blocks become plain blocks and their variables plain
    variables of the same names (TVM's ToNonDataflow would also re-normalize, adding bindings
    whose names clash with existing ones)."""
    func = mod[function]
    names = [binding.var.name for binding in _bindings(func.body)]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"bindings {repeated} share names; run ClassifyDynamism (or RDP) first, "
                         "which makes them unique")
    builder = relax.BlockBuilder()
    renamed: dict = {}

    def probe(var):
        call = relax.Call(relax.ExternFunc(PROBE_FUNCTION), [tvm.ir.StringImm(var.name), var], None,
                          [relax.TupleType([])])
        call = builder.normalize(call)
        return relax.VarBinding(relax.Var("_probe", call.ty), call)

    def rebuild(seq: relax.SeqExpr) -> relax.SeqExpr:
        bindings = []
        for block in seq.blocks:
            for binding in block.bindings:
                value = _substitute(binding.value, renamed, rebuild)
                var = relax.Var(binding.var.name, binding.var.ty)
                renamed[binding.var] = var
                if isinstance(binding, relax.MatchCast):
                    bindings.append(relax.MatchCast(var, value, binding.ty))
                else:
                    bindings.append(relax.VarBinding(var, value))
                if not isinstance(var.ty, relax.FuncType):
                    bindings.append(probe(var))
        return relax.SeqExpr([relax.BindingBlock(bindings)], _substitute(seq.body, renamed, rebuild))

    probed = relax.Function(func.params, rebuild(func.body), func.ret_ty, False, func.attrs)
    result = mod.clone()
    result[function] = probed
    return result


def _substitute(expr, renamed: dict, rebuild):
    """`expr` with the variables of `renamed` replaced (branches of an If rebuilt)."""
    if isinstance(expr, relax.Var) and expr in renamed:
        return renamed[expr]
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) \
            and expr.op.name.startswith("relax."):
        return relax.Call(expr.op, [_substitute(arg, renamed, rebuild) for arg in expr.args],
                          expr.attrs, expr.ty_args)
    if isinstance(expr, relax.Call) and not isinstance(expr.op, tvm.ir.Op):
        return relax.Call(_substitute(expr.op, renamed, rebuild),
                          [_substitute(arg, renamed, rebuild) for arg in expr.args], expr.attrs,
                          expr.ty_args)
    if isinstance(expr, relax.Tuple):
        return relax.Tuple([_substitute(field, renamed, rebuild) for field in expr.fields])
    if isinstance(expr, relax.TupleGetItem):
        return relax.TupleGetItem(_substitute(expr.tuple_value, renamed, rebuild), expr.index)
    if isinstance(expr, relax.If):
        return relax.If(_substitute(expr.cond, renamed, rebuild), rebuild(expr.true_branch),
                        rebuild(expr.false_branch))
    return expr  # constants, shapes and scalars over symbols, parameters, functions


def _bindings(seq: relax.SeqExpr):
    for block in seq.blocks:
        for binding in block.bindings:
            yield binding
            if isinstance(binding.value, relax.If):
                yield from _bindings(binding.value.true_branch)
                yield from _bindings(binding.value.false_branch)


class ShapeProbe:
    """Compile `mod` (an imported, normalized module, any analysis attributes on it) once with
    probes; `run` it at any input shapes. Weights kept as parameters are taken from main's
    `params` attribute, as the importer left them."""

    def __init__(self, mod: tvm.IRModule, target: str = "llvm"):
        self.device = tvm.cpu()
        main = mod["main"]
        attrs = main.attrs or {}
        self.num_input = int(attrs["num_input"]) if "num_input" in attrs else len(main.params)
        self.weights = [tvm.runtime.tensor(np.from_dlpack(value), self.device)
                        for value in attrs.get("params", [])]
        probed = with_probes(mod)
        with tvm.target.Target(target):
            probed = tvm.transform.Sequential([relax.backend.DispatchSampling(),
                                               relax.backend.DispatchSortScan()])(probed)
            executable = tvm.compile(probed, target)
        self._seen: dict[str, Observation] = {}
        # The VM resolves the probe when it is created and keeps that function: this instance's.
        tvm_ffi.register_global_func(PROBE_FUNCTION, self._record, override=True)
        self.vm = relax.VirtualMachine(executable, self.device)

    def _record(self, name, value) -> None:
        self._seen[str(name)] = observe(value)

    def run(self, inputs: list[np.ndarray]) -> tuple[dict[str, Observation], list]:
        """The observation of every binding the run reached, and the outputs (numpy)."""
        self._seen = {}
        arguments = [tvm.runtime.tensor(np.ascontiguousarray(array), self.device) for array in inputs]
        result = self.vm["main"](*arguments, *self.weights)
        outputs = [field.numpy() for field in result] if isinstance(result, tvm_ffi.Array) \
            else [result.numpy()]
        return self._seen, outputs
