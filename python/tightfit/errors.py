"""The exceptions tightfit raises: each says what went wrong, where, and what to do.

Every layer (API, passes, runtime, device_rpc) may import this module; it imports nothing of
tightfit, so it never creates a cycle. The CLI prints `str(error)` as one line and exits with
`error.exit_code`.
"""


class TightfitError(Exception):
    """Base class of every error tightfit raises on purpose."""

    exit_code = 1


class ModelLoadError(TightfitError):
    """The ONNX file is missing, unreadable or malformed."""

    exit_code = 2


class UnsupportedOperatorError(TightfitError):
    """The model uses ONNX operators that tightfit cannot import."""

    exit_code = 3

    def __init__(self, nodes: list[tuple[str, str]]):
        self.nodes = nodes
        listed = ", ".join(f"{name or '<unnamed>'} ({op})" for name, op in nodes[:8])
        more = f" and {len(nodes) - 8} more" if len(nodes) > 8 else ""
        ops = sorted({op for _, op in nodes})
        super().__init__(
            f"unsupported ONNX operator{'s' if len(ops) > 1 else ''} {', '.join(ops)} "
            f"at node{'s' if len(nodes) > 1 else ''} {listed}{more}; "
            "replace them in the exporter (e.g. a different torch op or opset) or file an issue "
            "with the model attached"
        )


class ConversionError(TightfitError):
    """An ONNX node is supported in general but could not be converted in this model."""

    exit_code = 3

    def __init__(self, node_name: str, op_type: str, reason: str):
        self.node_name = node_name
        self.op_type = op_type
        super().__init__(
            f"cannot convert node {node_name or '<unnamed>'} ({op_type}): {reason}; "
            "`tightfit inspect` shows what tightfit infers for the model, and fixing a dynamic "
            "input with --shape NAME=DIMS may help; otherwise file an issue with the model"
        )


class CompilationError(TightfitError):
    """A pass or the TVM build failed on an imported model."""

    exit_code = 4


class InputError(TightfitError):
    """The inputs given to a session do not match what the model declares."""

    exit_code = 5


class PackageError(TightfitError):
    """A compiled package is missing, incomplete, stale or corrupt."""

    exit_code = 6


class TargetError(TightfitError):
    """The target string or device description cannot be used."""

    exit_code = 7


class StalePackageError(PackageError):
    """The package was built by another tightfit/TVM version, for another target, or from a
    source model that has changed since."""


class CorruptPackageError(PackageError):
    """A package file is truncated, unreadable, or fails its hash."""


class DeviceError(TightfitError):
    """An RPC tracker, device or tuning session that cannot do what was asked."""

    exit_code = 8
