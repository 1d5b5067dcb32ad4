"""Give every operator of a Relax function its dynamism class, recorded as a function attribute.

SoD2 §3. Four classes, from least to most dynamic:
- ISDO, *input shape determines output*: shape and value follow from the input shapes alone
  (`Shape`, `Size`, `EyeLike`; `ConstantOfShape` and `Range` once their inputs are known);
- ISDOS, *input shape determines output shape*: `Conv`, `MatMul`, `Add`, pooling, activations;
- ISVDOS, *input shape and values determine output shape*: `Reshape`, `Expand`, `Tile`, `Slice`,
  `Range`, `ConstantOfShape`, `Resize`, `TopK` … while their shape-giving input is not known;
- EDO, *execution determines output*: `NonZero`, `Unique`, `NonMaxSuppression`, `If`.
The class follows constant propagation (SoD2 §3 "Discussion"): an op whose shape-giving inputs are
constants or symbolic expressions of the input symbols moves to the less dynamic class its rule
names (`when_known`). Two tables say this, one per level:
- `ONNX_OP_DYNAMISM`, for every ONNX op the frontend accepts (docs/dynamism-classes.md is
  generated from it: `python -m tightfit.dynamism --write-docs`);
- `RELAX_OP_DYNAMISM`, for the Relax ops the importer lowers them to — what this pass classifies,
  since the ONNX ops are gone once the graph is imported. Ops missing from it are EDO: nothing
  is assumed about an op nobody has looked at.

Where the result lives: Relax bindings have no attribute slot (TVM 0.27), so `main` and every
other Relax function get the attribute `tightfit.dynamism`, a map from binding name to class name,
printed by `mod.script()` in `R.func_attr` and read back by any later pass. To make the names keys,
the pass first renames bindings whose names repeat (the importer emits several `lv`); names change,
values do not. Only calls and `If` bindings are ops; aliases, tuples and match_casts are not listed.

At this step "known" is what the types say: a constant, or a shape or prim value whose expression
uses only the function's input symbols. RDP (passes/rdp.py) knows more (the values of shape
tensors) and re-classifies with `classify_binding` when it has run.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import tvm
from tvm import relax

ATTR_KEY = "tightfit.dynamism"


class Dynamism(enum.Enum):
    ISDO = "ISDO"
    ISDOS = "ISDOS"
    ISVDOS = "ISVDOS"
    EDO = "EDO"

    @property
    def meaning(self) -> str:
        return {
            "ISDO": "input shape determines output (shape and value)",
            "ISDOS": "input shape determines output shape",
            "ISVDOS": "input shape and input values determine output shape",
            "EDO": "execution determines output",
        }[self.value]


ISDO, ISDOS, ISVDOS, EDO = Dynamism.ISDO, Dynamism.ISDOS, Dynamism.ISVDOS, Dynamism.EDO


@dataclass(frozen=True)
class OpRule:
    """The class of an op while its shape-giving inputs are not known (`base`), which inputs
    those are (positions), and its class once all of them are known (`when_known`)."""

    base: Dynamism
    shape_inputs: tuple[int, ...] = ()
    when_known: Dynamism | None = None
    note: str = ""

    def classify(self, known: Callable[[int], bool]) -> Dynamism:
        if self.when_known is not None and all(known(position) for position in self.shape_inputs):
            return self.when_known
        return self.base

    def condition(self) -> str:
        """When the class changes with constant propagation, in words (for the docs table)."""
        if self.when_known is None:
            return ""
        inputs = ", ".join(str(position) for position in self.shape_inputs)
        noun = "input" if len(self.shape_inputs) == 1 else "inputs"
        return f"{self.when_known.value} when {noun} {inputs} known"


def _rules(names: str, rule: OpRule) -> dict[str, OpRule]:
    return {name: rule for name in names.split()}


_SHAPE_FROM_INPUT_1 = OpRule(ISVDOS, (1,), ISDOS)

# --- ONNX ops (every op tightfit's importer accepts; tests/passes check the set) -----------------
ONNX_OP_DYNAMISM: dict[str, OpRule] = {
    **_rules(
        "Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh Attention AveragePool "
        "BatchNormalization BiasGelu BitShift BitwiseAnd BitwiseNot BitwiseOr BitwiseXor Cast "
        "CastLike Ceil Celu Clip Concat ConcatFromSequence Conv ConvTranspose Cos Cosh CumSum "
        "DepthToSpace DequantizeLinear Div Dropout DynamicQuantizeLinear Einsum Elu "
        "EmbedLayerNormalization Equal Erf Exp FastGelu Flatten Floor Gather GatherElements "
        "GatherND Gelu Gemm GlobalAveragePool GlobalLpPool GlobalMaxPool Greater GreaterOrEqual "
        "GridSample GroupNormalization HardSigmoid HardSwish Hardmax Identity "
        "InstanceNormalization IsInf IsNaN LRN LayerNormalization LeakyRelu Less LessOrEqual Log "
        "LogSoftmax LpPool MatMul MatMulInteger MatMulInteger16 Max MaxPool MaxRoiPool Mean "
        "MeanVarianceNormalization Min Mish Mod Mul Neg NegativeLogLikelihoodLoss Not Optional "
        "OptionalGetElement Or PRelu "
        "Pow QuantizeLinear RMSNormalization Reciprocal Relu RoiAlign Round Scatter "
        "ScatterElements ScatterND Selu SequenceConstruct Shrink Sigmoid Sign Sin Sinh "
        "SkipLayerNormalization Softmax SoftmaxCrossEntropyLoss Softplus Softsign SpaceToDepth Sqrt "
        "Sub Sum Tan Tanh "
        "ThresholdedRelu Transpose Trilu Where Xor",
        OpRule(ISDOS)),
    **_rules("Shape Size EyeLike Constant SequenceEmpty SequenceLength OptionalHasElement",
             OpRule(ISDO)),
    **_rules("Reshape Expand Tile TopK OneHot Squeeze Unsqueeze Split Upsample AffineGrid "
             "SplitToSequence SequenceAt SequenceErase", _SHAPE_FROM_INPUT_1),
    **_rules("ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin "
             "ReduceProd ReduceSum ReduceSumSquare",
             OpRule(ISVDOS, (1,), ISDOS, "axes input (opset 13/18); axes given as an attribute: ISDOS")),
    "Slice": OpRule(ISVDOS, (1, 2, 3, 4), ISDOS),
    "Pad": OpRule(ISVDOS, (1, 3), ISDOS, "pads and axes"),
    "Resize": OpRule(ISVDOS, (2, 3), ISDOS, "scales or sizes"),
    "MaxUnpool": OpRule(ISVDOS, (2,), ISDOS, "output_shape input"),
    "SequenceInsert": OpRule(ISVDOS, (2,), ISDOS, "position input"),
    "Range": OpRule(ISVDOS, (0, 1, 2), ISDO),
    "ConstantOfShape": OpRule(ISVDOS, (0,), ISDO),
    **_rules("NonZero Unique NonMaxSuppression AllClassNMS Compress If", OpRule(EDO)),
}

# --- Relax ops (what the importer emits; tests/passes check it covers the imported node tests) ---
_RELAX_ISDOS = (
    "abs acos acosh add argmax argmin argsort asin asinh astype atan atan2 atanh bitwise_and "
    "bitwise_not bitwise_or bitwise_xor bucketize ceil clip collapse_sum_like concat cos cosh "
    "cumprod cumsum dequantize divide einsum equal erf ewise_fma exp expand_dims flatten flip floor "
    "floor_divide floor_mod full_like gather_elements gather_nd greater greater_equal "
    "image.affine_grid image.grid_sample index_tensor isfinite isinf isnan layout_transform "
    "left_shift less less_equal log log_add_exp logical_and logical_not logical_or logical_xor "
    "matmul max maximum mean median meshgrid min minimum mod multiply negative not_equal "
    "nn.adaptive_avg_pool1d nn.adaptive_avg_pool2d nn.adaptive_avg_pool3d nn.attention "
    "nn.attention_bias nn.avg_pool1d nn.avg_pool2d nn.avg_pool3d nn.batch_flatten nn.batch_norm "
    "nn.cross_entropy_with_logits nn.nll_loss "
    "nn.conv1d nn.conv1d_transpose nn.conv2d nn.conv2d_transpose nn.conv3d nn.conv3d_transpose "
    "nn.dropout nn.gelu nn.gelu_tanh nn.group_norm nn.instance_norm nn.layer_norm nn.leakyrelu "
    "nn.log_softmax nn.max_pool1d nn.max_pool2d nn.max_pool3d nn.pad nn.pixel_shuffle nn.prelu "
    "nn.relu nn.rms_norm nn.selu nn.silu nn.softmax nn.softplus one_hot outer permute_dims power "
    "prod quantize repeat reverse_sequence right_shift round rsqrt scatter_elements scatter_nd "
    "sigmoid sign sin sinh slice_scatter sort split sqrt square squeeze stack std strided_slice "
    "subtract sum take tan tanh tensor_to_shape tile topk tril triu trunc variance "
    "vision.roi_align vision.roi_pool where call_tir index_put"
)
RELAX_OP_DYNAMISM: dict[str, OpRule] = {
    **_rules(" ".join("relax." + name for name in _RELAX_ISDOS.split()), OpRule(ISDOS)),
    **_rules("relax.shape_of relax.size relax.eye relax.eye_like relax.ones_like relax.zeros_like",
             OpRule(ISDO)),
    "relax.shape_to_tensor": OpRule(ISDOS, (0,), ISDO, "a tensor of a known shape"),
    "relax.ones": OpRule(ISVDOS, (0,), ISDO),
    "relax.zeros": OpRule(ISVDOS, (0,), ISDO),
    "relax.full": OpRule(ISVDOS, (0,), ISDOS),
    "relax.arange": OpRule(ISVDOS, (0, 1, 2), ISDO),
    "relax.reshape": OpRule(ISVDOS, (1,), ISDOS),
    "relax.broadcast_to": OpRule(ISVDOS, (1,), ISDOS),
    "relax.collapse_sum_to": OpRule(ISVDOS, (1,), ISDOS),
    "relax.image.resize2d": OpRule(ISVDOS, (1,), ISDOS),
    "relax.image.resize3d": OpRule(ISVDOS, (1,), ISDOS),
    "relax.dynamic_strided_slice": OpRule(ISVDOS, (1, 2, 3), ISDOS),
    "relax.call_pure_packed:vm.builtin.tensor_to_shape": OpRule(ISDOS),
    **_rules("relax.nonzero relax.unique relax.vision.all_class_non_max_suppression "
             "relax.vision.non_max_suppression relax.vision.get_valid_counts "
             "relax.multinomial_from_uniform relax.call_pure_packed If", OpRule(EDO)),
}
UNKNOWN_OP_RULE = OpRule(EDO, note="no rule: assumed execution-determined")


def op_key(value: relax.Expr) -> str | None:
    """The RELAX_OP_DYNAMISM key of a binding's value, or None when it is not an op."""
    if isinstance(value, relax.If):
        return "If"
    if not isinstance(value, relax.Call):
        return None
    if isinstance(value.op, tvm.ir.Op):
        name = value.op.name
        if name == "relax.call_pure_packed" and isinstance(value.args[0], relax.ExternFunc):
            specific = f"{name}:{value.args[0].global_symbol}"
            return specific if specific in RELAX_OP_DYNAMISM else name
        return name
    return "call"  # a call of a function or closure: whatever its body does


def classify_binding(value: relax.Expr, is_known: Callable[[relax.Expr], bool]) -> Dynamism | None:
    """The class of the op bound by `value` given which argument values are known, or None."""
    key = op_key(value)
    if key is None:
        return None
    rule = RELAX_OP_DYNAMISM.get(key, UNKNOWN_OP_RULE)
    if isinstance(value, relax.If):
        return rule.base
    arguments = list(value.args)
    return rule.classify(lambda position: position < len(arguments) and is_known(arguments[position]))


def input_symbols(func: relax.Function) -> set:
    """The symbolic dims (TIR variables) the function's parameters define: symbolic constants."""
    symbols = set()
    for param in func.params:
        symbols.update(relax.analysis.tir_vars_in_type(param.ty))
    return symbols


def known_from_types(symbols: set) -> Callable[[relax.Expr], bool]:
    """`is_known` from types alone: constants, and shape/prim values over the input symbols."""

    def over_inputs(exprs) -> bool:
        return all(set(tvm.tirx.analysis.undefined_vars(expr)) <= symbols for expr in exprs)

    def is_known(arg: relax.Expr) -> bool:
        if isinstance(arg, tvm.ir.GenericConst):
            return True
        if isinstance(arg, relax.Tuple):
            return all(is_known(field) for field in arg.fields)
        ty = arg.ty
        if isinstance(ty, relax.ShapeType):
            return ty.values is not None and over_inputs(ty.values)
        if isinstance(ty, tvm.ir.PrimType):
            # a scalar argument is itself a TIR expression (TVM 0.27 has no PrimValue wrapper);
            # a Relax variable of scalar type holds a value computed at run time
            return not isinstance(arg, relax.Var) and over_inputs([arg])
        return False

    return is_known


@relax.expr_functor.mutator
class _UniqueBindingNames(relax.PyExprMutator):
    """Renames the second and later bindings of a name to `name_1`, `name_2`, …"""

    def __init__(self, mod, taken: set[str]):
        super().__init__(mod)
        self.taken = taken

    def _unique(self, var):
        if var.name not in self.taken:
            self.taken.add(var.name)
            return var
        suffix = 1
        while f"{var.name}_{suffix}" in self.taken:
            suffix += 1
        name = f"{var.name}_{suffix}"
        self.taken.add(name)
        renamed = (relax.DataflowVar if isinstance(var, relax.DataflowVar) else relax.Var)(name, var.ty)
        self.set_var_remap(var, renamed)
        return renamed

    def visit_var_binding_(self, binding):
        value = self.visit_expr(binding.value)
        self.builder_.emit_normalized(relax.VarBinding(self._unique(binding.var), value))

    def visit_match_cast_(self, binding):
        value = self.visit_expr(binding.value)
        self.builder_.emit_normalized(relax.MatchCast(self._unique(binding.var), value, binding.ty))


def with_unique_binding_names(func: relax.Function, mod: tvm.IRModule) -> relax.Function:
    """`func` with no two bindings, and no two symbols bound in its body, of the same name."""
    names = [binding.var.name for binding in iter_bindings(func)]
    if len(names) != len(set(names)):
        func = _UniqueBindingNames(mod, {param.name for param in func.params}).visit_expr(func)
    taken = {var.name for var in input_symbols(func)}
    renamed = {}
    for binding in iter_bindings(func):
        if not isinstance(binding, relax.MatchCast):
            continue
        for var in relax.analysis.tir_vars_in_type(binding.ty):
            if var in renamed or var in input_symbols(func):
                continue
            name, suffix = var.name, 0
            while name in taken:
                suffix += 1
                name = f"{var.name}_{suffix}"
            taken.add(name)
            renamed[var] = var if name == var.name else tvm.tirx.Var(name, "int64")
    renames = {var: new for var, new in renamed.items() if not new.same_as(var)}
    return func.bind_symbolic_vars(renames) if renames else func


def iter_bindings(func: relax.Function):
    """Every binding of `func`, in program order, those inside `If` branches included."""
    def walk(seq: relax.Expr):
        if not isinstance(seq, relax.SeqExpr):
            return
        for block in seq.blocks:
            for binding in block.bindings:
                if isinstance(binding.value, relax.If):
                    yield from walk(binding.value.true_branch)
                    yield from walk(binding.value.false_branch)
                yield binding

    yield from walk(func.body)


def dynamism_map(func: relax.Function, is_known: Callable[[relax.Expr], bool]) -> dict[str, str]:
    classes = {}
    for binding in iter_bindings(func):
        dynamism = classify_binding(binding.value, is_known)
        if dynamism is not None:
            classes[binding.var.name] = dynamism.value
    return classes


@tvm.transform.module_pass(opt_level=0, name="tightfit.ClassifyDynamism")
class ClassifyDynamism:
    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        result = mod.clone()
        for global_var, func in mod.functions.items():
            if not isinstance(func, relax.Function):
                continue
            func = with_unique_binding_names(func, mod)
            classes = dynamism_map(func, known_from_types(input_symbols(func)))
            result[global_var] = func.with_attr(ATTR_KEY, classes)
        return result
