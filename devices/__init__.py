"""mirrorsd.devices: which torch device runs the verifier, and in which dtype.

NPU discovery (ONNX Runtime providers, Core ML) and the draft placement policy join this package
with the exporters; today drafters run on torch devices or need none (n-gram).
"""

from mirrorsd.devices.torch_devices import best_torch_device, default_dtype, parse_dtype, resolve_device

__all__ = ["best_torch_device", "default_dtype", "parse_dtype", "resolve_device"]
