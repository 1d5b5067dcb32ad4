"""The ONNX loss ops (opset 12/13), which TVM 0.27 does not convert.

`NegativeLogLikelihoodLoss` and `SoftmaxCrossEntropyLoss` appear in exported training graphs and
in models that report their own loss. Both pick, for every sample (and spatial position), the
input at the target class along axis 1, weigh it by `weight[target]` (1 without weights) and by 0
where the target is `ignore_index`, and reduce: none, sum, or mean = sum / total weight (so
ignored positions do not count), as the ONNX specification states. A target outside the
classes (other than `ignore_index`) raises InputError when the model runs (ops_gather.py), where
the kernels would read past the inputs.
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend

from .ops_gather import checked_indices, take_in_range


def _negative_log_likelihood(bb: relax.BlockBuilder, log_probabilities: relax.Expr,
                             target: relax.Expr, weight: relax.Expr | None, attr: dict,
                             op: str) -> relax.Expr:
    """The loss of `log_probabilities` (N, C, d1...) at `target` (N, d1...)."""
    dtype = str(log_probabilities.ty.dtype)
    ignore_index = attr.get("ignore_index")
    target = bb.emit(relax.op.astype(target, "int64"))
    kept = None
    if ignore_index is not None:
        ignored = relax.op.equal(target, relax.const(ignore_index, "int64"))
        kept = bb.emit(relax.op.logical_not(ignored))
        # An ignored target may lie outside [0, C); read class 0 there, then weigh it by 0.
        target = bb.emit(relax.op.where(kept, target, relax.const(0, "int64")))
    target = checked_indices(bb, log_probabilities, target, [1], op, attr)
    picked = relax.op.gather_elements(log_probabilities, relax.op.expand_dims(target, 1), axis=1)
    loss = bb.emit(relax.op.negative(relax.op.squeeze(picked, [1])))
    if weight is None:
        weights = relax.op.ones_like(loss)
    else:
        weights = take_in_range(weight, target, 0)
    if kept is not None:
        weights = relax.op.multiply(weights, relax.op.astype(kept, dtype))
    weights = bb.emit(weights)
    loss = bb.emit(relax.op.multiply(loss, weights))
    reduction = attr.get("reduction", b"mean").decode("ascii")
    if reduction == "none":
        return loss
    if reduction == "sum":
        return bb.emit(relax.op.sum(loss))
    if reduction == "mean":
        return bb.emit(relax.op.divide(relax.op.sum(loss), relax.op.sum(weights)))
    raise ValueError(f"unknown reduction {reduction!r}; ONNX allows none, sum and mean")


def _optional(inputs, index: int):
    return inputs[index] if len(inputs) > index else None


class NegativeLogLikelihoodLoss(onnx_frontend.OnnxOpConverter):
    """The loss of log-probabilities (N, C, d1...) at integer targets (N, d1...)."""

    @classmethod
    def _impl_v12(cls, bb, inputs, attr, params):
        return _negative_log_likelihood(bb, inputs[0], inputs[1], _optional(inputs, 2), attr,
                                        "NegativeLogLikelihoodLoss")


class SoftmaxCrossEntropyLoss(onnx_frontend.OnnxOpConverter):
    """The negative log-likelihood of log_softmax over axis 1; the second output, when asked
    for, is that log_softmax."""

    @classmethod
    def _impl_v12(cls, bb, inputs, attr, params):
        log_probabilities = bb.emit(relax.op.nn.log_softmax(inputs[0], axis=1))
        loss = _negative_log_likelihood(bb, log_probabilities, inputs[1], _optional(inputs, 2),
                                        attr, "SoftmaxCrossEntropyLoss")
        return relax.Tuple([loss, log_probabilities])


CONVERTERS = {"NegativeLogLikelihoodLoss": NegativeLogLikelihoodLoss,
              "SoftmaxCrossEntropyLoss": SoftmaxCrossEntropyLoss}
