"""The placement policy: which chip runs the target and which runs the draft, and why.

A pure function of an Inventory (mirrorsd.devices.discovery) and the exported drafts on offer, so it
is tested against what a Mac, a Snapdragon laptop, an Intel Core Ultra laptop, an NVIDIA desktop and
a plain CPU box report:

- target: the user's --device, else a GPU (CUDA, MPS, XPU), else the CPU;
- draft: the user's --draft-device; else the first NPU backend present that the export fits
  (Core ML on Apple silicon; QNN on Snapdragon; OpenVINO NPU on Intel Core Ultra; VitisAI on Ryzen AI;
  DirectML where it lists an NPU); an export asked for by name with no NPU to take it runs on the
  CPU provider; `--draft auto` without an NPU and a compatible export is served by the model-free
  chain (n-gram + retrieval), as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from mirrorsd.devices.discovery import Inventory

COREML = "coreml"  # the native Core ML backend (an .mlpackage export), not the ONNX Runtime Core ML EP


@dataclass(frozen=True)
class ExportInfo:
    """What placement needs to know of an export (from its manifest.json)."""

    path: str
    format: str  # "onnx" | "coreml"
    profile: str  # "npu" | "dynamic"
    quant: str  # "none" | "int8" | "int4"

    @classmethod
    def from_manifest(cls, path, manifest: dict) -> "ExportInfo":
        return cls(str(path), manifest["format"], manifest["profile"], manifest.get("quant", "none"))


@dataclass(frozen=True)
class Placement:
    target: str  # torch device
    target_reason: str
    draft: str  # "export" (a model draft from `draft_export` on `draft_backend`) or "chain" (model-free)
    draft_backend: str | None  # ONNX Runtime provider name, or "coreml"
    draft_export: str | None
    draft_reason: str


def npu_backends(inv: Inventory) -> list[tuple[str, str]]:
    """(backend, what NPU it reaches), best first, for the NPUs this inventory shows."""
    found = []
    if inv.apple_silicon:
        if inv.coreml:
            found.append((COREML, "Apple Neural Engine via Core ML"))
        if "CoreMLExecutionProvider" in inv.providers:
            found.append(("CoreMLExecutionProvider", "Apple Neural Engine via ONNX Runtime's Core ML EP"))
    if "QNNExecutionProvider" in inv.providers:
        found.append(("QNNExecutionProvider", "Qualcomm Hexagon NPU via QNN (HTP backend)"))
    if "OpenVINOExecutionProvider" in inv.providers:
        listed = [d for d in inv.ep_devices if d.provider == "OpenVINOExecutionProvider"]
        if inv.has_ep_npu("OpenVINOExecutionProvider") or (not listed and "core(tm) ultra" in inv.cpu.lower()):
            found.append(("OpenVINOExecutionProvider", "Intel NPU via OpenVINO (device_type=NPU)"))
    if "VitisAIExecutionProvider" in inv.providers:
        found.append(("VitisAIExecutionProvider", "AMD Ryzen AI NPU via VitisAI"))
    if "DmlExecutionProvider" in inv.providers and inv.has_ep_npu("DmlExecutionProvider"):
        found.append(("DmlExecutionProvider", "NPU via DirectML"))
    return found


def compatible(export: ExportInfo, backend: str) -> bool:
    """Can `backend` run this export? NPUs need the static profile and no 4-bit MatMulNBits."""
    if backend == COREML:
        return export.format == "coreml"
    if export.format != "onnx":
        return False
    if backend in ("CPUExecutionProvider", "CUDAExecutionProvider"):
        return True
    if export.profile != "npu" or export.quant == "int4":
        return backend == "DmlExecutionProvider" and export.quant != "int4"
    if backend == "VitisAIExecutionProvider":
        return export.quant == "int8"  # VitisAI compiles QDQ int8 models
    return True


def _preference(export: ExportInfo, backend: str) -> int:
    """Lower is better: QNN, OpenVINO NPU and VitisAI run int8 QDQ fastest; the others float."""
    int8_first = backend in ("QNNExecutionProvider", "OpenVINOExecutionProvider", "VitisAIExecutionProvider")
    return 0 if (export.quant == "int8") == int8_first else 1


def _target_device(inv: Inventory, override: str | None) -> tuple[str, str]:
    if override and override != "auto":
        kind = override.split(":")[0]
        if kind != "cpu" and not any(b.kind == kind for b in inv.torch):
            return override, (f"asked for (--device), but torch sees no {kind} device here: a load there fails "
                              "with a hint, and nothing runs on it")
        return override, "asked for (--device)"
    for backend in inv.torch:
        if backend.kind in ("cuda", "mps", "xpu"):
            memory = f", {backend.memory_gb} GB" if backend.memory_gb else ""
            return backend.device, f"GPU: {backend.name}{memory}"
    return "cpu", "no GPU that torch can use: the CPU verifies"


def place(inv: Inventory, exports: list[ExportInfo] = (), explicit: bool = False, draft_device: str | None = None,
          target_device: str | None = None) -> Placement:
    """Decide. `exports`: the draft asked for by name (explicit=True), or the exports found for this
    target (auto). `draft_device`: a backend name the user named (provider alias or "coreml")."""
    from mirrorsd.devices.providers import provider_name

    target, target_reason = _target_device(inv, target_device)
    chain = "model-free chain (n-gram + retrieval)"
    if draft_device and draft_device != "auto":
        backend = COREML if draft_device.lower() == COREML else provider_name(draft_device)
        for export in exports:
            if compatible(export, backend):
                return Placement(target, target_reason, "export", backend, export.path,
                                 f"asked for (--draft-device {draft_device})")
        return Placement(target, target_reason, "chain", None, None,
                         f"no exported draft that {backend} can run was given or found: {chain}")
    npus = npu_backends(inv)
    for backend, what in npus:
        fitting = sorted((e for e in exports if compatible(e, backend)), key=lambda e: _preference(e, backend))
        if fitting:
            return Placement(target, target_reason, "export", backend, fitting[0].path, what)
    if explicit and exports:
        export = exports[0]
        why = "no NPU here" if not npus else f"{npus[0][0]} cannot run this export ({export.profile} profile, " \
                                             f"quant {export.quant})"
        if export.format == "coreml":
            return Placement(target, target_reason, "export", COREML, export.path,
                             f"{why}; a Core ML export runs only through Core ML on macOS")
        gpu = "CUDAExecutionProvider" in inv.providers and target.startswith("cpu")
        backend = "CUDAExecutionProvider" if gpu else "CPUExecutionProvider"
        return Placement(target, target_reason, "export", backend, export.path,
                         f"{why}: the draft you asked for runs on {backend}")
    if npus:
        return Placement(target, target_reason, "chain", None, None,
                         f"{npus[0][1]} present but no compatible exported draft found (mirrorsd export "
                         f"--profile npu): {chain}")
    return Placement(target, target_reason, "chain", None, None, f"no NPU: {chain}")
