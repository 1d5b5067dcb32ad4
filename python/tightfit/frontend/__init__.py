"""ONNX import: TVM's frontend plus tightfit's converters and error reporting."""

from .importer import ImportedModel, TensorSpec, declared_inputs, import_onnx, load_onnx

__all__ = ["ImportedModel", "TensorSpec", "declared_inputs", "import_onnx", "load_onnx"]
