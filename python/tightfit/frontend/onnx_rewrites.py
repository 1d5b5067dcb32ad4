"""ONNX-level clean-ups applied before the Relax import.

Rewrites here keep the model's meaning exactly; they exist where an exported pattern is easier to
fix in ONNX than in Relax.
"""

import onnx


def rewrite_onnx_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """Return a copy of `model` ready for the importer; the caller's model is not changed."""
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    return rewritten
