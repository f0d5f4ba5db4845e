"""What this machine has, from the libraries' own calls: torch backends, ONNX Runtime providers and
plugin-EP devices, Core ML / the Neural Engine on macOS, the CPU.

`discover()` is the only function here that looks at the machine; everything it finds lands in an
`Inventory`, a plain value that the placement policy (mirrorsd.devices.placement) reads, so the
policy can be tested against inventories built for other machines.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TorchBackend:
    kind: str  # "cuda", "mps", "xpu", "cpu"
    name: str
    index: int | None = None
    memory_gb: float | None = None

    @property
    def device(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"


@dataclass(frozen=True)
class EpDevice:
    """One ONNX Runtime (plugin) execution-provider device, from onnxruntime.get_ep_devices()."""

    provider: str
    device_type: str  # "CPU", "GPU", "NPU"
    vendor: str = ""


@dataclass(frozen=True)
class Inventory:
    system: str  # platform.system(): "Darwin", "Windows", "Linux"
    machine: str  # platform.machine(): "arm64", "x86_64", "AMD64", "ARM64"
    cpu: str
    cores: int
    torch: tuple[TorchBackend, ...]
    providers: tuple[str, ...]  # onnxruntime.get_available_providers(), () without onnxruntime
    ep_devices: tuple[EpDevice, ...] = ()  # onnxruntime.get_ep_devices() where this onnxruntime has it
    coreml: bool = False  # coremltools importable (Core ML packages can be loaded and predicted on macOS)
    notes: tuple[str, ...] = field(default=())

    @property
    def apple_silicon(self) -> bool:
        return self.system == "Darwin" and self.machine.lower() in ("arm64", "aarch64")

    def has_ep_npu(self, provider: str) -> bool:
        return any(d.provider == provider and d.device_type == "NPU" for d in self.ep_devices)


def _cpu_name() -> str:
    name = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if platform.system() == "Darwin":
        import subprocess

        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=5).stdout.strip() or name
        except (OSError, subprocess.SubprocessError):
            pass
    return name or platform.machine()


def torch_backends() -> tuple[TorchBackend, ...]:
    import torch

    found: list[TorchBackend] = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            found.append(TorchBackend("cuda", props.name, i, round(props.total_memory / 2**30, 1)))
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        found.append(TorchBackend("mps", "Apple GPU (Metal)"))
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        for i in range(xpu.device_count()):
            found.append(TorchBackend("xpu", xpu.get_device_name(i), i))
    found.append(TorchBackend("cpu", _cpu_name()))
    return tuple(found)


def onnxruntime_devices() -> tuple[tuple[str, ...], tuple[EpDevice, ...], list[str]]:
    notes: list[str] = []
    try:
        import onnxruntime as ort
    except ImportError:
        return (), (), ["onnxruntime is not installed: exported ONNX drafts cannot run (pip install onnxruntime)"]
    providers = tuple(ort.get_available_providers())
    devices: list[EpDevice] = []
    if hasattr(ort, "get_ep_devices"):  # onnxruntime >= 1.22: plugin execution providers and their devices
        for d in ort.get_ep_devices():
            devices.append(EpDevice(d.ep_name, d.device.type.name, d.device.vendor))
    else:
        notes.append(f"onnxruntime {ort.__version__} cannot list EP devices (get_ep_devices needs >= 1.22)")
    return providers, tuple(devices), notes


def discover() -> Inventory:
    providers, ep_devices, notes = onnxruntime_devices()
    coreml = False
    if platform.system() == "Darwin":
        try:
            import coremltools  # noqa: F401

            coreml = True
        except ImportError:
            notes.append("coremltools is not installed: Core ML drafts cannot run (pip install coremltools)")
    return Inventory(platform.system(), platform.machine(), _cpu_name(), os.cpu_count() or 1, torch_backends(),
                     providers, ep_devices, coreml, tuple(notes))
