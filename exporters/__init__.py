"""mirrorsd.exporters: a draft model -> ONNX (NPU static / dynamic profile, quantized) or Core ML, with a
manifest.json and validation against PyTorch."""

from mirrorsd.exporters.export import export_draft, export_verifier
from mirrorsd.export_format import is_export, read_manifest
from mirrorsd.exporters.validate import validate_export

__all__ = ["export_draft", "export_verifier", "is_export", "read_manifest", "validate_export"]
