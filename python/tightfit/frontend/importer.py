"""ONNX → Relax import: TVM's ONNX frontend, with tightfit's converters where it falls short.

DESIGN.md pipeline step 1. TVM's `ONNXGraphImporter` does the graph walk; tightfit's layer
(subclassing it, never patching TVM) adds:
- its own op converters (`converters.py`) that take precedence over TVM's;
- ONNX-level clean-ups applied before the walk (`onnx_rewrites.py`);
- errors that name the node and op (`tightfit.errors`), raised before any IR is built when an
  op is unknown;
- shape values (Relax `ShapeExpr`) handed to ops that only take tensors are converted to int64
  tensors for that node alone, instead of failing the import;
- every nameless dynamic input dim gets its own symbol (TVM would make them all one variable).
Weights stay function parameters (`num_input` real inputs first) so the package can keep them
in its own weight file.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
import tvm
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend

from ..errors import ConversionError, ModelLoadError, TightfitError, UnsupportedOperatorError
from .converters import CONVERTERS
from .onnx_rewrites import rewrite_onnx_model

# Ops that TVM's importer lets receive ShapeExpr inputs (onnx_frontend._construct_nodes).
_TVM_SHAPE_COMPATIBLE_OPS = frozenset(
    ["Reshape", "Resize", "ConstantOfShape", "Gather", "Slice", "Shape", "Expand", "Concat",
     "Equal", "Where", "Cast", "CastLike", "Squeeze"]
)
_OPS_HANDLED_BY_IMPORTER = frozenset(["If", "Constant"])
MAX_BOUND_WEIGHT_ELEMENTS = 64


@dataclass(frozen=True)
class TensorSpec:
    """A model input or output as the ONNX graph declares it.

    `shape` holds ints for static dims, the symbol name for dynamic ones, None for unknown rank.
    """

    name: str
    shape: tuple[int | str, ...] | None
    dtype: str

    def to_json(self) -> dict:
        return {"name": self.name, "shape": None if self.shape is None else list(self.shape),
                "dtype": self.dtype}

    @staticmethod
    def from_json(data: dict) -> TensorSpec:
        shape = None if data["shape"] is None else tuple(data["shape"])
        return TensorSpec(data["name"], shape, data["dtype"])


@dataclass
class ImportedModel:
    """The Relax module of an ONNX model, with its weights kept apart from the code."""

    mod: tvm.IRModule
    weights: dict[str, np.ndarray]  # in the order of main's parameters after the inputs
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    onnx_model: onnx.ModelProto


def load_onnx(model: str | Path | onnx.ModelProto) -> onnx.ModelProto:
    """Read and check an ONNX model; raise ModelLoadError saying what is wrong with it."""
    if isinstance(model, onnx.ModelProto):
        proto = model
        where = "the given ModelProto"
    else:
        path = Path(model)
        where = str(path)
        if not path.is_file():
            raise ModelLoadError(f"no ONNX file at {path}; check the path")
        try:
            proto = onnx.load(str(path))
        except (DecodeError, ValueError, OSError) as err:
            raise ModelLoadError(
                f"{path} is not a readable ONNX model ({type(err).__name__}: {err}); "
                "re-export it, e.g. with torch.onnx.export"
            ) from err
    if not proto.graph.node:
        raise ModelLoadError(f"{where} has an empty graph; is it really an ONNX model?")
    try:
        # Given a path, the checker reads the file itself instead of serializing the model again.
        onnx.checker.check_model(proto if isinstance(model, onnx.ModelProto) else str(model))
    except onnx.checker.ValidationError as err:
        first_line = str(err).strip().splitlines()[0]
        raise ModelLoadError(
            f"{where} fails the ONNX checker: {first_line}; fix the exporter or the file"
        ) from err
    return proto


def find_unsupported_nodes(graph: onnx.GraphProto) -> list[tuple[str, str]]:
    """(node name, op) of every node, in subgraphs too, that no converter handles."""
    known = set(onnx_frontend._get_convert_map()) | set(CONVERTERS) | _OPS_HANDLED_BY_IMPORTER
    missing = []
    for node in graph.node:
        if node.domain not in ("", "ai.onnx") or node.op_type not in known:
            missing.append((node.name, node.op_type))
        for attribute in node.attribute:
            for subgraph in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                missing.extend(find_unsupported_nodes(subgraph))
    return missing


def import_onnx(model: str | Path | onnx.ModelProto,
                input_shapes: dict[str, list[int | str]] | None = None) -> ImportedModel:
    """Import an ONNX model into Relax with symbolic dims kept as TIR variables.

    `input_shapes` overrides the declared shape of the named inputs (ints fix a dim, strings
    name a symbol).
    """
    proto = load_onnx(model)
    proto = rewrite_onnx_model(proto)
    unsupported = find_unsupported_nodes(proto.graph)
    if unsupported:
        raise UnsupportedOperatorError(unsupported)

    inputs = declared_inputs(proto.graph)
    if input_shapes:
        unknown = set(input_shapes) - {spec.name for spec in inputs}
        if unknown:
            raise ModelLoadError(
                f"--shape names {sorted(unknown)}, which are not inputs of the model; "
                f"its inputs are {[spec.name for spec in inputs]}"
            )
        inputs = [TensorSpec(s.name, tuple(input_shapes.get(s.name, s.shape)), s.dtype)
                  for s in inputs]
    importer = _TightfitGraphImporter(
        shape_dict=_relax_shapes(inputs),
        dtype_dict={s.name: s.dtype for s in inputs},
        keep_params_in_input=True,
        sanitize=True,
    )
    importer.expected_dtypes = inferred_dtypes(proto)
    mod = _bind_match_cast_values(importer.from_onnx(proto.graph, _default_opset(proto)))
    # Views of the importer's TVM tensors: the weights are not copied again.
    weights = {name: np.from_dlpack(value) for name, (_, value) in importer._params.items()}
    mod, weights = _bind_small_weights(mod, weights)
    outputs = [_tensor_spec(value_info) for value_info in proto.graph.output]
    return ImportedModel(mod, weights, inputs, outputs, proto)


@relax.expr_functor.mutator
class _MatchCastValueBinder(relax.PyExprMutator):
    def visit_match_cast_(self, binding: relax.MatchCast) -> None:
        value = self.visit_expr(binding.value)
        if isinstance(value, relax.Call):
            value = self.builder_.emit(value)
        self.builder_.emit_normalized(relax.MatchCast(binding.var, value, binding.ty))


def _bind_match_cast_values(mod: tvm.IRModule) -> tvm.IRModule:
    """Bind each call that a `match_cast` casts to a variable of its own.

    Converters, TVM's and tightfit's, cast calls as they make them
    (`bb.match_cast(relax.op.nonzero(x), ...)`), and the block builder leaves the call nested in
    the cast; the passes read every call from a binding of its own (RDP, the dynamism classes,
    NonZero's lowering)."""
    binder = _MatchCastValueBinder(mod)
    for global_var, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            binder.builder_.update_func(global_var, binder.visit_expr(func))
    return binder.builder_.get()


def _bind_small_weights(mod: tvm.IRModule, weights: dict[str, np.ndarray]):
    """Make initializers of at most MAX_BOUND_WEIGHT_ELEMENTS elements constants of the IR.

    Small initializers are shapes, axes, scales and clip bounds: as constants they fold, and ops
    that need their values (Reshape, Clip, Pad) see them. Large ones stay parameters of `main`;
    their values stay in its `params` attribute, in parameter order, for the weight passes.
    """
    small = {name: value for name, value in weights.items()
             if value.size <= MAX_BOUND_WEIGHT_ELEMENTS}
    if small:
        mod = relax.transform.BindParams("main", {name: tvm.runtime.from_dlpack(value)
                                                  for name, value in small.items()})(mod)
    large = {name: value for name, value in weights.items() if name not in small}
    main = mod["main"].without_attr("params")
    if large:
        main = main.with_attr("params", [tvm.runtime.from_dlpack(value) for value in large.values()])
    mod = mod.clone()
    mod["main"] = main
    return mod, large


class _TightfitGraphImporter(onnx_frontend.ONNXGraphImporter):
    """TVM's graph walk, one node at a time, so that each node can be prepared and blamed."""

    expected_dtypes: dict[str, str] = {}

    def _check_for_unsupported_ops(self, graph):
        # import_onnx has checked the whole graph, subgraphs included, with tightfit's errors.
        return

    def _construct_nodes(self, graph: onnx.GraphProto):
        for node in graph.node:
            try:
                self._convert_node(node, all_shapes_as_tensors=False)
            except TightfitError:
                raise
            except Exception as err:  # the importer raises bare exceptions of many kinds
                if not self._has_shape_inputs(node):
                    raise ConversionError(node.name, node.op_type, _reason(err)) from err
                # TVM folds shape arithmetic into ShapeExprs but its converters take them only in
                # some input positions; the same node on int64 tensors is always well-defined.
                try:
                    self._convert_node(node, all_shapes_as_tensors=True)
                except Exception:
                    raise ConversionError(node.name, node.op_type, _reason(err)) from err
            self._conform_output_dtypes(node)
            self._name_unknown_dims(node)

    def _convert_node(self, node: onnx.NodeProto, all_shapes_as_tensors: bool) -> None:
        as_tensors = all_shapes_as_tensors or not (node.op_type in _TVM_SHAPE_COMPATIBLE_OPS
                                                   or node.op_type in CONVERTERS)
        single_node_graph = onnx.GraphProto()
        single_node_graph.node.append(self._with_shape_inputs_as_tensors(node) if as_tensors else node)
        # TVM prints its own diagnostic before re-raising; tightfit's error says it all.
        with contextlib.redirect_stdout(io.StringIO()):
            super()._construct_nodes(single_node_graph)

    def _has_shape_inputs(self, node: onnx.NodeProto) -> bool:
        return any(isinstance(self._nodes.get(name), relax.Expr)
                   and isinstance(self._nodes[name].ty, relax.ShapeType) for name in node.input)

    def _name_unknown_dims(self, node: onnx.NodeProto) -> None:
        """Give a tensor whose rank is known but whose dims are not a fresh symbol per dim.

        Relax loses a shape when it cannot prove operands agree (a concat of two maps resized in
        different ways) or when values decide it; without a shape, later ops cannot be lowered.
        `match_cast` to fresh symbols keeps them lowerable and is checked when the model runs.
        """
        for name in node.output:
            value = self._nodes.get(name)
            if not isinstance(value, relax.Expr) or not isinstance(value.ty, relax.TensorType):
                continue
            ty = value.ty
            if ty.shape is not None or ty.ndim < 0:
                continue
            symbols = [tvm.tirx.Var(f"{_identifier(name)}_d{axis}", "int64") for axis in range(ty.ndim)]
            self._nodes[name] = self.bb.match_cast(value, relax.TensorType(symbols, ty.dtype))

    def _conform_output_dtypes(self, node: onnx.NodeProto) -> None:
        """Give each output the element type ONNX says it has.

        TVM's converters sometimes compute in another type: a float cast of folded shape
        arithmetic becomes a float64 scalar (PyTorch's attention scale 1/sqrt(d)), indices come out
        int32. Downstream ops then meet mismatched operands, and outputs differ from the model's.
        """
        for name in node.output:
            expected = self.expected_dtypes.get(name)
            value = self._nodes.get(name)
            if expected is None or not isinstance(value, relax.Expr):
                continue
            ty = value.ty
            if isinstance(ty, relax.TensorType) and ty.dtype not in ("", None) and str(ty.dtype) != expected:
                self._nodes[name] = self.bb.emit(relax.op.astype(value, expected))
            elif isinstance(ty, tvm.ir.PrimType) and str(ty.dtype) != expected:
                self._nodes[name] = _cast_prim(value, expected)

    def _with_shape_inputs_as_tensors(self, node: onnx.NodeProto) -> onnx.NodeProto:
        prepared = onnx.NodeProto()
        prepared.CopyFrom(node)
        for position, name in enumerate(node.input):
            value = self._nodes.get(name)
            if isinstance(value, relax.ShapeExpr) or (isinstance(value, relax.Expr)
                                                      and isinstance(value.ty, relax.ShapeType)):
                tensor_name = f"{name}::as_tensor"
                if tensor_name not in self._nodes:
                    self._nodes[tensor_name] = self.bb.emit(relax.op.shape_to_tensor(value))
                prepared.input[position] = tensor_name
        return prepared

    def _convert_operator(self, op_name, inputs, attrs, opset):
        converter = CONVERTERS.get(op_name)
        if converter is None:
            return super()._convert_operator(op_name, inputs, attrs, opset)
        converted = converter.get_converter(opset)(self.bb, inputs, attrs,
                                                   [self._nodes, self._params])
        if isinstance(converted, relax.Expr):
            converted = self.bb.normalize(converted)
        return converted


def declared_inputs(graph: onnx.GraphProto) -> list[TensorSpec]:
    initializers = {init.name for init in graph.initializer}
    return [_tensor_spec(value_info) for value_info in graph.input
            if value_info.name not in initializers]


def _tensor_spec(value_info: onnx.ValueInfoProto) -> TensorSpec:
    tensor_type = value_info.type.tensor_type
    dtype = onnx_frontend.get_type(tensor_type.elem_type) if tensor_type.elem_type else "float32"
    if not tensor_type.HasField("shape"):
        return TensorSpec(value_info.name, None, dtype)
    # A dim with neither value nor name gets a name of its own: it is independent of the others.
    dims = tuple(
        dim.dim_value if dim.HasField("dim_value")
        else (dim.dim_param or f"{_identifier(value_info.name)}_dim{axis}")
        for axis, dim in enumerate(tensor_type.shape.dim)
    )
    return TensorSpec(value_info.name, dims, dtype)


def _relax_shapes(inputs: list[TensorSpec]) -> dict[str, list]:
    """Relax shapes for the inputs, one TIR variable per symbol name across all inputs."""
    symbols: dict[str, tvm.tirx.Var] = {}
    shapes = {}
    for spec in inputs:
        if spec.shape is None:
            continue
        shapes[spec.name] = [
            dim if isinstance(dim, int) else symbols.setdefault(dim, tvm.tirx.Var(dim, "int64"))
            for dim in spec.shape
        ]
    return shapes


def _cast_prim(value, dtype: str):
    """A scalar (Relax's prim value: a TIR expression) in another type, folded when constant."""
    if isinstance(value, tvm.tirx.FloatImm) and dtype.startswith("float"):
        return tvm.tirx.FloatImm(dtype, value.value)
    if isinstance(value, tvm.tirx.IntImm) and dtype.startswith(("int", "uint")):
        return tvm.tirx.IntImm(dtype, value.value)
    return tvm.tirx.Cast(dtype, value)


def _reason(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def inferred_dtypes(proto: onnx.ModelProto) -> dict[str, str]:
    """Element type of every tensor of the main graph that ONNX shape inference can type.

    Inference runs on a copy without initializer data (types do not depend on it), so a large
    model's weights are not copied.
    """
    graph = proto.graph
    declared = {value_info.name for value_info in graph.input}
    weight_inputs = [onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
                     for init in graph.initializer if init.name not in declared]
    light_graph = onnx.helper.make_graph(graph.node, graph.name, list(graph.input) + weight_inputs,
                                         graph.output, value_info=graph.value_info)
    light = onnx.helper.make_model(light_graph, opset_imports=proto.opset_import,
                                   ir_version=proto.ir_version)
    try:
        inferred = onnx.shape_inference.infer_shapes(light)
    except Exception:  # inference is an aid here; the import proceeds without it
        return {}
    dtypes = {}
    for value_info in [*inferred.graph.value_info, *inferred.graph.output, *inferred.graph.input]:
        elem_type = value_info.type.tensor_type.elem_type
        if value_info.type.HasField("tensor_type") and elem_type:
            dtypes[value_info.name] = onnx_frontend.get_type(elem_type)
    return dtypes


def _identifier(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name)


def _default_opset(proto: onnx.ModelProto) -> int:
    for opset in proto.opset_import:
        if opset.domain in ("", "ai.onnx"):
            return opset.version
    return 1
