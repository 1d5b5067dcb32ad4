"""Choose each convolution's algorithm by cost and replace it with that tightfit kernel.

MNN §3.1 (pre-inference: "計算策略選擇", the strategy is chosen per op from its sizes by a cost
model) and DESIGN.md step 6. For every `relax.nn.conv2d` (NCHW/OIHW, fp32, weights known at
compile time) the candidates are
- `direct`: implicit GEMM on register tiles of pixels x output channels (schedules/conv2d.py),
  written back to NCHW through a transpose; workspace = the packed (channels-last) input;
- `width_vectors`: register tiles of output channels x a vector of output columns, NCHW
  throughout; workspace = the padded input (none for a pointwise conv). Measured 1.05-2.6x
  faster than `direct` on the zoo's layers, and 1.6-1.8x on 7x7 and 10-wide maps although it
  computes a whole vector of columns there (conv_cost.KERNEL_EFFICIENCY); but 3x3 convs over
  32 channels or more and a static plane ran as `direct` in 0.40-1.0 of its time (ResNet's
  stride-2 convs, where Winograd does not apply: conv_cost.DIRECT_EFFICIENCY_BY_CHANNELS); a pointwise conv over
  256+ input channels runs its CHANNEL_VECTORS version instead, vectors along the output
  channels (conv2d.uses_channel_vectors);
- `im2col`: explicit im2col + GEMM: the input unfolded to C x KH x KW channels per output
  pixel by a kernel of its own, then the pointwise width-vectors GEMM over the flattened
  pixels (no wasted columns on short rows); workspace = the unfolded input, the largest of all.
  Not for pointwise convs (nothing to unfold). On this host it measured 1.05-1.9x slower than
  `width_vectors` on 3x3 convs and 1.3x faster on 1x1 stride-2 convs (ResNet's downsampling
  shortcuts, where the unfolding is a subsample), which is where the model picks it
  (conv_cost.IM2COL_*);
- `depthwise`: the per-channel kernel, the only candidate when groups == channels.
- `winograd_f2`, `winograd_f4`: Winograd F(2x2, 3x3) / F(4x4, 3x3) for 3x3 stride-1 convs
  (schedules/winograd.py): the weights transformed offline, an input-transform kernel, a
  batched dense GEMM per transform point, an output-transform kernel that takes the epilogue;
  workspace = the transformed input and the GEMM's result.
Cost of a candidate = its multiply-adds / its measured multiply-add rate + the bytes its stages
move / the memory bandwidth + the transforms' arithmetic, all in seconds (schedules/conv_cost.py);
the rates come from the knob database where recorded, else from MNN-style defaults (conv_cost.py).
Where the knob database holds the candidates' times measured on the target for this conv
(`tightfit search`, python/tightfit/algorithm_search.py), those rank them instead. The cheapest
candidate that fits `max_workspace_bytes` wins (a memory budget may lower it: FlexNN's kernel
choice under a budget). Symbolic extents are costed at
`typical_extent` (or the function's `tir_var_upper_bound`), and Winograd's transforms over a
symbolic height or width at their measured slowdown there (conv_cost.py).

The choice is recorded in the IR, on the kernel's PrimFunc: `tightfit.algorithm`,
`tightfit.conv_key` (the knob database's key for the conv's measured times),
`tightfit.workspace_bytes` and `tightfit.weight_bytes` (symbolic where the shape is), and
`tightfit.candidates` (name, estimated and measured microseconds, bytes) for every candidate
considered.
Weight packing/transforms are emitted as weight-only bindings, so PreTransformWeights, which
runs after this pass, computes them once at compile time and stores the result.
A conv1d (NCW) is rewritten as the conv2d of a one-row image between an expand_dims and a
squeeze, and then chosen and emitted as any conv2d.
A grouped conv (not depthwise) has the one candidate that takes groups, `width_vectors`, with
channel rows that divide each group's output channels.
Limits: non-float32 convs and convs whose weight is computed at run time keep TVM's
legalization.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx

from ..schedules import conv2d, gemm, winograd
from ..schedules.conv_cost import (
    WINOGRAD_TILES,
    Candidate,
    ConvShape,
    Rates,
    candidate_costs,
    choose,
    with_measurements,
)
from ..schedules.isa import isa_for_target
from ..schedules.kernel_call import WeightOnly, emit_kernel, emit_weight_transform
from ..schedules.knob_database import KnobDatabase
from ..schedules.register_tile import TileKnobs, default_tile_knobs

DEFAULT_TYPICAL_EXTENT = 32
# Output channels per weight panel of the direct conv when the knob database has no record: the
# knob search on the zoo's CNNs (resnet_style, mobilenet_v2_style, conv_dynamic_hw,
# detector_fpn; AVX-512 host) chose 16-channel panels with 8-12 pixel rows for every conv
# bucket, also where 32 or 64 channels would fit two or four vectors: a conv's tile is written
# back transposed to NCHW, and taller tiles write longer rows.
CONV_PANEL_WIDTH = 16


class ConvCosting:
    """How the pass costs the convs of one function for the current target: the target's vector
    ISA and rates, the knob database's measurements, the symbolic dims' typical extents."""

    def __init__(self, func: relax.Function, database: KnobDatabase,
                 typical_extent: int = DEFAULT_TYPICAL_EXTENT,
                 algorithms: tuple[str, ...] | None = None):
        self.isa = isa_for_target(tvm.target.Target.current(allow_none=True))
        self.database = database
        self.rates = Rates.for_target(self.isa, _target_threads(), database.rates())
        self.typical = _typical_extents(func, typical_extent)
        self.algorithms = algorithms

    def shape(self, call: relax.Call) -> ConvShape:
        return ConvShape.from_call(call, self.typical)

    def estimates(self, call: relax.Call) -> list[Candidate]:
        """The allowed candidates of a conv2d or conv1d call, as the cost model estimates them."""
        costs = candidate_costs(self.shape(call), self.isa, self.rates)
        # a conv none of the allowed algorithms applies to (im2col on a pointwise conv, Winograd
        # on a strided one) keeps its own candidates
        allowed = [c for c in costs if self.algorithms is None or c.name in self.algorithms]
        return allowed or costs

    def candidates(self, call: relax.Call) -> list[Candidate]:
        """The candidates to choose from: those measured on the target, with their times, where
        the knob database has this conv's times; else the estimates."""
        return with_measurements(self.estimates(call),
                                 self.database.conv_times(self.shape(call).measurement_key))


@relax.expr_functor.mutator
class _ConvRewriter(relax.PyExprMutator):
    def __init__(self, mod, func, costing: ConvCosting, max_workspace_bytes):
        super().__init__(mod)
        self.weight_only = WeightOnly(func)
        self.costing = costing
        self.isa = costing.isa
        self.database = costing.database
        self.max_workspace_bytes = max_workspace_bytes

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        if _is_supported_conv1d(value) and self.weight_only(value.args[1]):
            self.set_var_remap(binding.var, self._rewrite_conv1d(value, binding.var.name))
            return
        if not _is_supported_conv(value) or not self.weight_only(value.args[1]):
            super().visit_var_binding_(binding)
            return
        data, weight = (self.visit_expr(arg) for arg in value.args)
        self.set_var_remap(binding.var, self._choose_and_emit(value, data, weight,
                                                              binding.var.name, value.args[1]))

    def _rewrite_conv1d(self, call: relax.Call, name: str) -> relax.Var:
        """A conv1d is a conv2d over images one row high: the input and weight get a unit
        height (expand_dims and squeeze are views, RewriteDataflowReshape keeps them free),
        the conv2d gets its algorithm and kernel as any other."""
        data, weight = (self.visit_expr(arg) for arg in call.args)
        attrs = call.attrs
        (stride,), (dilation,), (left, right) = (
            [int(v) for v in values] for values in (attrs.strides, attrs.dilation, attrs.padding))
        data_2d = self.builder_.emit(relax.op.expand_dims(data, [2]))
        weight_2d = self.builder_.emit(relax.op.expand_dims(weight, [2]))
        conv_2d = self.builder_.normalize(relax.op.nn.conv2d(
            data_2d, weight_2d, strides=[1, stride], padding=[0, left, 0, right],
            dilation=[1, dilation], groups=int(attrs.groups)))
        out_2d = self._choose_and_emit(conv_2d, data_2d, weight_2d, f"{name}_2d", call.args[1])
        return self.builder_.emit(relax.op.squeeze(out_2d, [2]), name)

    def _choose_and_emit(self, call, data, weight, name, source_weight):
        """Cost the candidates of the conv2d `call`, emit the cheapest; `source_weight` names the
        packed weight in the weight file."""
        costs = self.costing.candidates(call)
        chosen = choose(costs, self.max_workspace_bytes)
        return self._emit(chosen.name, call, data, weight, costs, name, source_weight)

    def _emit(self, algorithm, call, data, weight, costs, name, source_weight):
        attrs = call.attrs
        out_channels = int(call.args[1].ty.shape[0])
        strides = [int(s) for s in attrs.strides]
        dilation = [int(d) for d in attrs.dilation]
        padding = [int(p) for p in attrs.padding]
        out_width = call.ty.shape[3]
        record = {
            "tightfit.algorithm": algorithm,
            "tightfit.candidates": [c.as_record() for c in costs],
            "tightfit.conv_key": self.costing.shape(call).measurement_key,
        }
        if algorithm == "depthwise":
            kernel_h, kernel_w = (int(d) for d in call.args[1].ty.shape.values[2:])
            record.update(_footprint(costs, algorithm))
            return emit_kernel(self.builder_, conv2d.conv2d_depthwise, [data, weight],
                               "conv2d_depthwise", record, name, strides=strides, padding=padding,
                               dilation=dilation, vector_width=self.isa.lanes,
                               rows=conv2d.depthwise_rows(self.isa, kernel_h, kernel_w))
        if algorithm in WINOGRAD_TILES:
            record.update(_footprint(costs, algorithm))
            return self._emit_winograd(WINOGRAD_TILES[algorithm], call, data, weight, record,
                                       name, source_weight)
        if algorithm == "im2col":
            return self._emit_im2col(call, data, weight, record, costs, name, source_weight)
        if algorithm == "width_vectors":
            groups = int(attrs.groups)
            pointwise = conv2d.is_pointwise(*call.args[1].ty.shape.values[2:], strides, padding)
            row_extent = out_width * call.ty.shape[2] if pointwise else out_width
            in_channels = int(call.args[1].ty.shape[1]) * groups
            channel_vectors = pointwise and conv2d.uses_channel_vectors(
                self.isa, in_channels, out_channels, groups, _pointwise_weight_bytes(call))
            knobs = self.database.tile_knobs(conv2d.tile_kind(pointwise), out_channels, row_extent,
                                             self.isa)
            if channel_vectors:
                knobs = TileKnobs(rows=conv2d.CHANNEL_VECTORS_PANEL, vectors=1)
            elif knobs is None or (groups > 1 and (out_channels // groups) % knobs.rows):
                knobs = conv2d.width_tile_knobs(
                    self.isa, out_channels, _pointwise_weight_bytes(call) if pointwise else None,
                    groups)
            packed = emit_weight_transform(self.builder_, conv2d.pack_conv2d_weight, [weight],
                                           "conv2d_weight_rows",
                                           self.weight_only.transformed_name(source_weight, "rows"),
                                           panel_width=knobs.rows)
            record.update(_footprint(costs, algorithm))
            return emit_kernel(self.builder_, conv2d.conv2d_width_vectors, [data, packed],
                               "conv2d_width_vectors", record, name, out_channels=out_channels,
                               strides=strides, padding=padding, dilation=dilation,
                               vectors=knobs.vectors, lanes=self.isa.lanes, groups=groups,
                               channel_vectors=channel_vectors)
        knobs = self.database.tile_knobs(conv2d.DIRECT, out_channels, out_width, self.isa)
        knobs = knobs or default_tile_knobs(self.isa, out_channels, out_width, CONV_PANEL_WIDTH)
        packed = emit_weight_transform(self.builder_, conv2d.pack_conv2d_weight, [weight],
                                       "conv2d_weight_panels",
                                       self.weight_only.transformed_name(source_weight, "panels"),
                                       panel_width=knobs.vectors * self.isa.lanes)
        record.update(_footprint(costs, algorithm))
        return emit_kernel(self.builder_, conv2d.conv2d_direct, [data, packed], "conv2d_direct",
                           record, name, out_channels=out_channels, strides=strides,
                           padding=padding, dilation=dilation, rows=knobs.rows,
                           vectors=knobs.vectors, reduction_unroll=knobs.reduction_unroll)

    def _emit_im2col(self, call, data, weight, record, costs, name, source_weight):
        """The unfolded input as its own kernel, then the pointwise width-vectors GEMM over it
        (which FuseOps gives the conv's epilogue), its weight packed offline."""
        attrs = call.attrs
        out_channels, _, kernel_h, kernel_w = (int(d) for d in call.args[1].ty.shape.values)
        row_extent = call.ty.shape[2] * call.ty.shape[3]
        knobs = (self.database.tile_knobs(conv2d.tile_kind(True), out_channels, row_extent, self.isa)
                 or conv2d.width_tile_knobs(self.isa, out_channels,
                                            _pointwise_weight_bytes(call) * kernel_h * kernel_w))
        packed = emit_weight_transform(self.builder_, conv2d.pack_im2col_weight, [weight],
                                       "im2col_weight_rows",
                                       self.weight_only.transformed_name(source_weight, "im2col"),
                                       panel_width=knobs.rows)
        columns = self.builder_.emit(self.builder_.call_te(
            conv2d.im2col, data, kernel=(kernel_h, kernel_w),
            strides=[int(s) for s in attrs.strides], padding=[int(p) for p in attrs.padding],
            dilation=[int(d) for d in attrs.dilation], primfunc_name_hint="im2col"),
            f"{name}_im2col")
        record.update(_footprint(costs, "im2col"))
        return emit_kernel(self.builder_, conv2d.conv2d_width_vectors, [columns, packed],
                           "conv2d_width_vectors", record, name, out_channels=out_channels,
                           strides=[1, 1], padding=[0, 0, 0, 0], dilation=[1, 1],
                           vectors=knobs.vectors, lanes=self.isa.lanes)

    def _emit_winograd(self, tile, call, data, weight, record, name, source_weight):
        """Weights transformed offline, then input transform, GEMM per point, output transform
        (which FuseOps gives the conv's epilogue)."""
        out_channels = int(call.args[1].ty.shape[0])
        gemm_rows = winograd.tile_count(call.ty.shape.values, tile)
        knobs = (self.database.tile_knobs(gemm.DENSE, out_channels, gemm_rows, self.isa)
                 or default_tile_knobs(self.isa, out_channels, gemm_rows))
        transformed = emit_weight_transform(
            self.builder_, winograd.winograd_weight, [weight], "winograd_weight",
            self.weight_only.transformed_name(source_weight, f"winograd{tile}"), tile=tile,
            panel_width=knobs.vectors * self.isa.lanes)
        padding = [int(p) for p in call.attrs.padding]
        tile_grid = emit_kernel(self.builder_, winograd.winograd_input, [data], "winograd_input",
                                {}, f"{name}_winograd_input", plain_dims=True, tile=tile,
                                padding=padding)
        batch, tiles_h, tiles_w, points, channels = tile_grid.ty.shape.values
        tiles = self.builder_.emit(relax.op.reshape(
            tile_grid, [batch, tiles_h * tiles_w, points, channels]))
        products = emit_kernel(self.builder_, gemm.dense_packed, [tiles, transformed],
                               "dense_packed", {"tightfit.algorithm": gemm.DENSE},
                               f"{name}_winograd_gemm", out_features=out_channels,
                               rows=knobs.rows, vectors=knobs.vectors,
                               reduction_unroll=knobs.reduction_unroll, points_inside=True)
        return emit_kernel(self.builder_, winograd.winograd_output, [products], "winograd_output",
                           record, name, out_shape=list(call.ty.shape.values), tile=tile)


@tvm.transform.module_pass(opt_level=0, name="tightfit.SelectConvAlgorithm")
class SelectConvAlgorithm:
    def __init__(self, database_path: str | None = None, max_workspace_bytes: int | None = None,
                 typical_extent: int = DEFAULT_TYPICAL_EXTENT,
                 algorithms: tuple[str, ...] | None = None):
        self.database_path = database_path
        self.algorithms = algorithms  # allowed candidates (depthwise convs have only their own)
        self.max_workspace_bytes = max_workspace_bytes
        self.typical_extent = typical_extent

    def transform_module(self, mod: tvm.IRModule, ctx) -> tvm.IRModule:
        database = KnobDatabase.open(self.database_path, tvm.target.Target.current(allow_none=True))
        for global_var, func in list(mod.functions.items()):
            if not isinstance(func, relax.Function) or not convs_to_choose(func):
                continue
            costing = ConvCosting(func, database, self.typical_extent, self.algorithms)
            rewriter = _ConvRewriter(mod, func, costing, self.max_workspace_bytes)
            new_func = rewriter.visit_expr(func)
            mod = rewriter.builder_.get()
            mod[global_var] = relax.analysis.remove_all_unused(new_func)
        return mod


def _is_supported_conv(value) -> bool:
    return _is_supported(value, "relax.nn.conv2d", ("NCHW", "OIHW", "NCHW"))


def _is_supported_conv1d(value) -> bool:
    """An NCW/OIW fp32 conv1d with a constant-shape weight."""
    return _is_supported(value, "relax.nn.conv1d", ("NCW", "OIW", "NCW"))


def _is_supported(value, op_name: str, layouts: tuple[str, str, str]) -> bool:
    """A call of `op_name` in `layouts`, fp32, with a constant-shape weight and a static channel
    count (any groups: depthwise, grouped or none)."""
    if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
        return False
    if value.op.name != op_name:
        return False
    attrs = value.attrs
    data_ty, weight_ty = value.args[0].ty, value.args[1].ty
    if (attrs.data_layout, attrs.kernel_layout, attrs.out_layout) != layouts:
        return False
    if data_ty.dtype != "float32" or weight_ty.dtype != "float32" or str(attrs.out_dtype or "float32") not in ("", "void", "float32"):
        return False
    if weight_ty.shape is None or not all(isinstance(d, tirx.IntImm) for d in weight_ty.shape.values):
        return False
    return data_ty.shape is not None and isinstance(data_ty.shape.values[1], tirx.IntImm)


def convs_to_choose(func: relax.Function) -> list[relax.Call]:
    """The conv2d and conv1d calls of `func` this pass chooses an algorithm for: supported, with
    a weight known at compile time."""
    weight_only = WeightOnly(func)
    found = []
    relax.analysis.post_order_visit(
        func, lambda node: found.append(node)
        if (_is_supported_conv(node) or _is_supported_conv1d(node)) and weight_only(node.args[1])
        else None)
    return found


def _pointwise_weight_bytes(call: relax.Call) -> int:
    out_channels, in_channels = (int(d) for d in call.args[1].ty.shape.values[:2])
    return out_channels * in_channels * tvm.runtime.DataType(call.args[1].ty.dtype).bits // 8


def _footprint(costs, algorithm: str) -> dict:
    chosen = next(c for c in costs if c.name == algorithm)
    return {"tightfit.workspace_bytes": chosen.workspace_bytes,
            "tightfit.weight_bytes": chosen.weight_bytes}


def _target_threads() -> int:
    target = tvm.target.Target.current(allow_none=True)
    return int(dict(target.attrs).get("num-cores", 1)) if target is not None else 1


def _typical_extents(func: relax.Function, default: int) -> dict:
    """Symbolic dims costed at their declared upper bound, or `default`."""
    bounds = dict(func.attrs["tir_var_upper_bound"]) if func.attrs and "tir_var_upper_bound" in func.attrs else {}
    return {"default": default, **{str(k): int(v) for k, v in bounds.items()}}
