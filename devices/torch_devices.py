"""torch device discovery, the per-device default dtype, and the machine's identity for measured costs."""

from __future__ import annotations

import os
import platform

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

    bfloat16 is faster on a CPU, but its greedy output depends on how tokens are grouped into forward
    passes (K+1 verified at once, or a cached prompt prefix vs a whole prefill), because its rounding
    after every layer flips near-tie argmaxes (docs/measurements.md). Lossless comes first, so
    bfloat16/float16 are opt-in (`dtype="bfloat16"`), documented as trading exact token identity for
    speed. (The static-shape backend, runtime/backends/torch_static.py, runs every pass in one shape, so its
    loader picks bfloat16 on a CUDA GPU: exact there too.)
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


def machine_id(torch_threads: bool = True) -> str:
    """What measured costs (pipeline="auto"'s calibration) depend on besides the models: the CPU, the cores this
    process may use, torch's threads (torch_threads=False: left out, for what torch does not compute), the GPUs."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    threads = f"{torch.get_num_threads()} torch threads, " if torch_threads else ""
    return f"{platform.system()} {cpu}, {cores} cores, {threads}GPUs {gpus}"
