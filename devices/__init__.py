"""mirrorsd.devices: what this machine has (discovery), where the target and the draft run
(placement), the torch device and dtype of the target, and ONNX Runtime provider options."""

from mirrorsd.devices.discovery import EpDevice, Inventory, TorchBackend, discover
from mirrorsd.devices.placement import ExportInfo, Placement, compatible, npu_backends, place
from mirrorsd.devices.torch_devices import best_torch_device, default_dtype, machine_id, parse_dtype, resolve_device

__all__ = ["EpDevice", "ExportInfo", "Inventory", "Placement", "TorchBackend", "best_torch_device", "compatible",
           "default_dtype", "discover", "machine_id", "npu_backends", "parse_dtype", "place", "resolve_device"]
