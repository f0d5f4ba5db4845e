"""What a target/draft pair costs per pass on each device, and what the pipeline's cost model makes of it.

For a machine the pair's weights cannot reach (the GPU machine lent to this project has no package registry
and takes 64 MiB per call: docs/gpu-pipeline.md), the models are built from their configs with random
weights: a pass's time depends on the shapes, not the values. Acceptance does depend on the values, so alpha
comes from a run of the real pair (--alpha; greedy token-equality makes it the same on every device).

    python scripts/pair_costs.py --target-config DIR --draft-config DIR --alpha 0.92
        [--target-devices cuda] [--draft-devices cuda cpu] [--dtypes float32 bfloat16]

Prints seconds per verify pass of K drafted tokens (K+1 positions after a 200-token context), seconds per
draft token, and for each placement (target device x draft device) the best-K speedup over target-only,
sequential and overlapped (runtime/decode/policy/speedup.py, verify growth fitted from the measured curve).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from mirrorsd.runtime.backends.torch_lm import TorchCausalLM
from mirrorsd.runtime.decode.policy.speedup import speedup

KS = (0, 1, 2, 4, 8, 16)


def synced(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pass_seconds(lm: TorchCausalLM, k: int, repeats: int = 5) -> float:
    """Median seconds of one pass over K+1 new positions after a 200-token context in the cache."""
    times = []
    for r in range(repeats + 1):  # the first pass warms the kernels for this shape and is not counted
        context = list(range(1000, 1200)) + list(range(5000, 5000 + 20 * r))
        lm.score(context[:-1])
        synced(lm.device)
        start = time.perf_counter()
        lm.score(context, list(range(7000, 7000 + k)))
        synced(lm.device)
        times.append(time.perf_counter() - start)
    lm.reset()
    return statistics.median(times[1:])


def build(config_dir: str, device: str, dtype: torch.dtype) -> TorchCausalLM:
    config = AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return TorchCausalLM(model, device)


def growth_of(curve: list[float]) -> float:
    """Verify cost growth per drafted token in plain steps: least squares through (0, 0) of V(K)/V(0) - 1."""
    pts = [(k, v / curve[0] - 1.0) for k, v in zip(KS, curve) if k]
    return max(0.0, sum(k * y for k, y in pts) / sum(k * k for k, _ in pts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target-config", required=True)
    ap.add_argument("--draft-config", required=True)
    ap.add_argument("--alpha", type=float, required=True, help="the real pair's measured acceptance rate")
    ap.add_argument("--target-devices", nargs="+", default=["cuda"])
    ap.add_argument("--draft-devices", nargs="+", default=["cuda", "cpu"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = ap.parse_args()
    verify: dict[tuple[str, str], list[float]] = {}
    draft: dict[tuple[str, str], float] = {}
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for device in dict.fromkeys(args.target_devices + args.draft_devices):
            if device in args.target_devices:
                lm = build(args.target_config, device, dtype)
                verify[device, dtype_name] = [pass_seconds(lm, k) for k in KS]
                lm.close()
                print(f"target on {device} {dtype_name}: " + ", ".join(f"K={k} {s:.4f}s" for k, s in
                                                                        zip(KS, verify[device, dtype_name])),
                      flush=True)
            if device not in args.draft_devices:
                continue
            lm = build(args.draft_config, device, dtype)
            draft[device, dtype_name] = pass_seconds(lm, 0)
            lm.close()
            print(f"draft on {device} {dtype_name}: {draft[device, dtype_name]:.4f} s/token", flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    print(f"\n{gpu}; {platform.processor() or platform.machine()}, {torch.get_num_threads()} CPU threads; torch "
          f"{torch.__version__}. Seconds per verify pass of K drafted tokens (K+1 positions after a 200-token "
          "context; median of 5), in units of a plain decode step (K=0)\n")
    print("| target on | dtype | " + " | ".join(f"K={k}" for k in KS) + " | growth per token |")
    print("|---|---|" + "---|" * (len(KS) + 1))
    for (device, dtype_name), curve in verify.items():
        print(f"| {device} | {dtype_name} | " + " | ".join(f"{s:.4f} s ({s / curve[0]:.2f})" for s in curve)
              + f" | {growth_of(curve):.3f} |")
    print(f"\nModelled with alpha = {args.alpha} (measured on the real pair): best K for each, speedup over "
          "target-only decoding on the same target device\n")
    print("| target on | draft on | dtype | draft s/token | c | sequential (K) | overlap (K) | overlap / sequential |")
    print("|---|---|---|---|---|---|---|---|")
    for (t_device, dtype_name), curve in verify.items():
        g = growth_of(curve)
        for (d_device, d_dtype), d in draft.items():
            if d_dtype != dtype_name:
                continue
            c = d / curve[0]
            seq = max((speedup(args.alpha, k, c, False, growth=g), k) for k in range(1, 17))
            ovl = max((speedup(args.alpha, k, c, True, growth=g), k) for k in range(1, 17))
            print(f"| {t_device} | {d_device} | {dtype_name} | {d:.4f} | {c:.2f} | {seq[0]:.2f}x ({seq[1]}) | "
                  f"{ovl[0]:.2f}x ({ovl[1]}) | {ovl[0] / seq[0]:.2f}x |")


if __name__ == "__main__":
    main()
