"""ONNX Runtime execution providers: names, the options each NPU needs, sessions for an export."""

from __future__ import annotations

import platform
from pathlib import Path

from mirrorsd.errors import ExportError, ProviderError

# Short names users type (--draft-device) -> ONNX Runtime provider names.
ALIASES = {
    "cpu": "CPUExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
    "ane": "CoreMLExecutionProvider",
    "qnn": "QNNExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "openvino-npu": "OpenVINOExecutionProvider",
    "dml": "DmlExecutionProvider",
    "directml": "DmlExecutionProvider",
    "vitisai": "VitisAIExecutionProvider",
    "cuda": "CUDAExecutionProvider",
}

# Providers that put the draft on an NPU (with the options below).
NPU_PROVIDERS = ("CoreMLExecutionProvider", "QNNExecutionProvider", "OpenVINOExecutionProvider",
                 "VitisAIExecutionProvider", "DmlExecutionProvider")

INSTALL_HINTS = {
    "QNNExecutionProvider": "pip install onnxruntime-qnn (Windows on Snapdragon)",
    "OpenVINOExecutionProvider": "pip install onnxruntime-openvino (Intel Core Ultra NPU)",
    "DmlExecutionProvider": "pip install onnxruntime-directml (Windows)",
    "VitisAIExecutionProvider": "install AMD's Ryzen AI software, which ships onnxruntime-vitisai",
    "CoreMLExecutionProvider": "the standard onnxruntime wheel for macOS has it",
    "CUDAExecutionProvider": "pip install onnxruntime-gpu",
}


def provider_name(spec: str) -> str:
    """'qnn' -> 'QNNExecutionProvider'; full provider names pass through."""
    return ALIASES.get(spec.lower(), spec)


def default_options(provider: str, system: str | None = None) -> dict:
    """What each NPU provider needs to put the draft on the NPU rather than its CPU fallback."""
    system = system or platform.system()
    if provider == "CoreMLExecutionProvider":
        return {"ModelFormat": "MLProgram", "MLComputeUnits": "CPUAndNeuralEngine", "RequireStaticInputShapes": "1"}
    if provider == "QNNExecutionProvider":
        return {"backend_path": "QnnHtp.dll" if system == "Windows" else "libQnnHtp.so",
                "htp_performance_mode": "burst"}
    if provider == "OpenVINOExecutionProvider":
        return {"device_type": "NPU"}
    return {}


def make_sessions(folder: Path, manifest: dict, provider: str, options: dict | None = None,
                  threads: int | None = None) -> dict:
    """One InferenceSession per graph of an export, on `provider` (CPU fallback for what it refuses)."""
    import onnxruntime as ort

    provider = provider_name(provider)
    available = ort.get_available_providers()
    if provider not in available:
        raise ProviderError(
            f"ONNX Runtime provider {provider} is not installed here (available: {', '.join(available)})",
            INSTALL_HINTS.get(provider, "install the onnxruntime package that ships it") +
            "; or run the draft on the CPU provider (--draft-device cpu)",
        )
    if manifest.get("profile") == "dynamic" and provider in ("QNNExecutionProvider", "OpenVINOExecutionProvider"):
        raise ProviderError(f"{provider} needs static shapes but this export has the dynamic profile",
                            "re-export with `mirrorsd export --profile npu`")
    opts = {**default_options(provider), **(options or {})}
    providers = [(provider, opts)] + ([] if provider == "CPUExecutionProvider" else ["CPUExecutionProvider"])
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    sessions = {}
    for name, graph in manifest["graphs"].items():
        path = folder / graph["file"]
        if not path.is_file():
            raise ExportError(f"{path} is missing from the export", "re-run `mirrorsd export`")
        try:
            sessions[name] = ort.InferenceSession(str(path), so, providers=providers)
        except Exception as exc:
            raise ExportError(f"ONNX Runtime could not load {path} on {provider}: {str(exc).splitlines()[0]}",
                              "the file is corrupt, truncated or from an incompatible tool: re-run `mirrorsd "
                              "export`; if only an NPU provider refuses it, use --draft-device cpu") from exc
    return sessions
