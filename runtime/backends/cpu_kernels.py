"""CPU helpers: the physical core count backends default their threads to, and faster float32 linear
layers on the CPU: oneDNN's inner product instead of the default BLAS call.

Why: torch's default float32 `F.linear` (MKL sgemm) is slow for the small row counts speculative
decoding feeds it (a verify pass over 2-9 positions), while oneDNN's inner product (the kernel behind
torch.compile's CPU linear) runs those shapes near the memory-bandwidth bound. The figures are in
docs/measurements.md; `scripts/bench_kernels.py` measures them on your machine.

`use_onednn_linear(model)` switches every nn.Linear of a model to it, in place: same weights, same
module tree and state dict, results equal to F.linear up to float32 rounding (checked on the spot;
any failure leaves the model as it was). Target-only decoding and speculative decoding then run the
same kernels, so "lossless" keeps meaning what it did. `MIRRORSD_CPU_LINEAR=default` turns it off.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger("mirrorsd")

ENV = "MIRRORSD_CPU_LINEAR"


class OneDNNLinear(torch.nn.Linear):
    """nn.Linear whose forward is oneDNN's float32 inner product (dense weight, no repacking)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad:  # the op has no backward: training keeps F.linear
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


@functools.cache
def onednn_linear_available() -> bool:
    """oneDNN is built in, the op exists, and it agrees with F.linear on a small check (once per process)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(*s, generator=gen) for s in ((1, 3, 64), (32, 64), (32,)))
        with torch.inference_mode():
            got = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        return bool(torch.allclose(got, F.linear(x, w, b), atol=1e-4, rtol=1e-4))
    except Exception:  # noqa: BLE001 - any failure means: keep the default kernel
        return False


def onednn_linear_wanted() -> bool:
    """Not turned off by MIRRORSD_CPU_LINEAR=default (which asks for torch's own kernels)."""
    return os.environ.get(ENV, "onednn") != "default"


def use_onednn_linear(model: torch.nn.Module) -> int:
    """Switch the model's float32 CPU nn.Linear layers to OneDNNLinear; returns how many were switched
    (0 when turned off by MIRRORSD_CPU_LINEAR=default, off the CPU, not float32, or oneDNN unusable)."""
    if not onednn_linear_wanted():
        return 0
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear
              and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]
    if not layers or not onednn_linear_available():
        return 0
    for m in layers:
        m.__class__ = OneDNNLinear
    log.debug("oneDNN float32 linear for %d layers", len(layers))
    return len(layers)


def physical_cores() -> int:
    """Physical cores this process may run on (llama.cpp's threads gain nothing from SMT siblings)."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in allowed:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            return max(1, len(allowed))
    return max(1, len(cores))
