"""Compute every weight transform once, at compile time, and keep only its result.

FlexNN "offline weight pre-transformation" and the XNNPack weight cache's packing. TVM's
`LiftTransformParams` splits off `main_transform_params`: every binding that depends on weights
alone (transposes of Gemm weights, bias reshapes, later Winograd and packing transforms). This
pass compiles that function for the build machine, runs it on the weights held in `main`'s
`params` attribute, and leaves a `main` that takes the transformed weights, with
- `params`: the transformed values, in `main`'s parameter order after the `num_input` inputs;
- `tightfit.weight_keys`: for each, the content key of the weight file (`weight_file.content_key`
  of the source weights' bytes, the transform's bindings, the layout and the target), so a stored
  weight is reused only when all four are the same.
A module whose `main` has no `params` attribute (weights already bound as constants) is returned
unchanged.
"""

from __future__ import annotations

import hashlib

import numpy as np
import tvm
from tvm import relax

from ..weight_file import content_key

TRANSFORM_FUNCTION = "main_transform_params"


@tvm.transform.module_pass(opt_level=0, name="tightfit.PreTransformWeights")
class PreTransformWeights:
    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        main = mod["main"]
        if main.attrs is None or "params" not in main.attrs:
            return mod
        source_values = list(main.attrs["params"])
        num_input = int(main.attrs["num_input"])
        source_names = [param.name for param in main.params[num_input:]]
        digests = {name: hashlib.sha256(np.from_dlpack(value)).hexdigest()
                   for name, value in zip(source_names, source_values)}
        lifted = relax.transform.LiftTransformParams()(mod)
        transform = lifted[TRANSFORM_FUNCTION]
        outputs = _run_on_host(lifted, source_values)
        target = str(tvm.target.Target.current(allow_none=True) or "llvm")
        keys = []
        for index, (sources, recipe) in enumerate(_output_recipes(transform, source_names)):
            value = outputs[index]
            layout = f"{value.dtype}{list(value.shape)} row-major"
            keys.append(content_key([f"{name}:{digests[name]}" for name in sources], recipe, layout, target))
        new_main = (lifted["main"].with_attr("params", outputs)
                    .with_attr("tightfit.weight_keys", keys))
        result = lifted.clone()
        result["main"] = new_main
        del result[result.get_global_var(TRANSFORM_FUNCTION)]
        return relax.transform.DeadCodeElimination(["main"])(result)


def _run_on_host(lifted: tvm.IRModule, weights: list[tvm.runtime.Tensor]) -> list[tvm.runtime.Tensor]:
    """Compile `main_transform_params` alone for this machine and apply it to `weights`."""
    transform_only = lifted.clone()
    del transform_only[transform_only.get_global_var("main")]
    transform_only = relax.transform.DeadCodeElimination([TRANSFORM_FUNCTION])(transform_only)
    host = tvm.target.Target({"kind": "llvm"})
    with host:
        executable = tvm.compile(transform_only, host)
    vm = relax.VirtualMachine(executable, tvm.cpu())
    return list(vm[TRANSFORM_FUNCTION](weights))


def _output_recipes(transform: relax.Function, source_names: list[str]) -> list[tuple[list[str], str]]:
    """For each output of the transform: the source weights it reads and its bindings as text.

    The bindings are the backward slice from the output, printed in program order; reads of the
    weights tuple are left out of the text (the sources are listed by name instead).
    """
    ordered = [binding for block in transform.body.blocks for binding in block.bindings]
    bindings = {binding.var: binding.value for binding in ordered}
    position = {binding.var: index for index, binding in enumerate(ordered)}
    outputs = transform.body.body
    if outputs.same_as(transform.params[0]):  # nothing to transform: the weights pass through
        return [([name], "identity") for name in source_names]
    output_tuple = bindings.get(outputs, outputs)
    recipes = []
    for field in output_tuple.fields:
        slice_vars = sorted(_backward_slice(field, bindings), key=position.get)
        sources = [source_names[bindings[var].index] for var in slice_vars
                   if _is_weight_read(bindings[var])]
        text = "\n".join(f"{var.name} = {bindings[var]}" for var in slice_vars
                         if not _is_weight_read(bindings[var]))
        recipes.append((sources, text or "identity"))
    return recipes


def _backward_slice(expr: relax.Expr, bindings: dict) -> set:
    """The bound variables `expr` depends on, transitively."""
    seen: set = set()
    pending = [expr]
    while pending:
        current = pending.pop()
        used = [current] if isinstance(current, relax.Var) else relax.analysis.free_vars(current)
        for var in used:
            if var in bindings and var not in seen:
                seen.add(var)
                pending.append(bindings[var])
    return seen


def _is_weight_read(value) -> bool:
    return isinstance(value, relax.TupleGetItem) and isinstance(value.tuple_value, relax.Var)
