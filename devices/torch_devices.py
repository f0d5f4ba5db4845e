"""torch device discovery and the per-device default dtype."""

from __future__ import annotations

import torch

from mirrorsd.errors import ConfigError

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def best_torch_device() -> torch.device:
    """CUDA > MPS > CPU, by torch's own availability checks."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def resolve_device(spec: str | None) -> torch.device:
    """"auto"/None -> best_torch_device(); otherwise the named device, checked to exist."""
    if spec in (None, "", "auto"):
        return best_torch_device()
    try:
        device = torch.device(spec)
    except RuntimeError as exc:
        raise ConfigError(f"unknown torch device {spec!r}", "use auto, cpu, cuda, cuda:N or mps") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {spec!r} asked for but torch sees no CUDA GPU", "use --device cpu or auto")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"device {spec!r} does not exist ({torch.cuda.device_count()} CUDA devices)", "use cuda:0")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device {spec!r} asked for but MPS is not available", "use --device cpu or auto")
    return device


def default_dtype(device: torch.device) -> torch.dtype:
    """float32 on every device: the only dtype measured to keep greedy output token-identical.

    Measured on the 2-core x86-64 CPU (torch 2.13): bfloat16 decodes faster (smollm2-135m one step
    34 ms vs 56 ms; qwen2.5-coder-1.5b about 3.1 vs 2.4 tok/s), but scoring K+1 tokens in one pass
    runs different matmul kernels than one-token decoding, and with bfloat16 rounding after every
    layer that flipped a near-tie argmax: on smollm2-135m an n-gram-drafted greedy run left
    target-only decoding at token 43. In float32 the same runs were identical. Lossless comes first,
    so bfloat16/float16 are opt-in (`dtype="bfloat16"`), documented as trading exact token identity
    for speed.
    """
    return torch.float32


def parse_dtype(spec: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if spec is None or spec == "auto":
        return default_dtype(device)
    if isinstance(spec, torch.dtype):
        return spec
    try:
        return _DTYPES[spec.lower()]
    except KeyError:
        raise ConfigError(f"unknown dtype {spec!r}", f"use one of auto, {', '.join(sorted(_DTYPES))}") from None
