"""mirrorsd.exporters: a draft model -> ONNX (NPU static / dynamic profile, quantized) or Core ML, with a
manifest.json and validation against PyTorch."""

from mirrorsd.exporters.export import ROLE_ALIASES, export_draft, export_target
from mirrorsd.export_format import is_export, read_manifest
from mirrorsd.exporters.phases import PhaseLog, quiet_tools
from mirrorsd.exporters.validate import Limits, validate_export

__all__ = ["ROLE_ALIASES", "Limits", "PhaseLog", "export_draft", "export_target", "is_export", "quiet_tools", "read_manifest",
           "validate_export"]
