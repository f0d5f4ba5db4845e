"""Verify-pass cost by draft length K, per model backend, side by side in one run.

A verify pass scores K+1 positions (the last committed token and K drafted ones) after a context held in
the KV cache. How its time grows with K decides which K pays on each backend (the K schedule measures it
at run time; this prints the curve). Each backend loads the same catalog model: torch in float32 (oneDNN
linear layers on the CPU) and llama.cpp on the GGUF file as it is.

    .venv/bin/python scripts/verify_cost.py [--target qwen2.5-coder-1.5b] [--backends torch llamacpp onnx]
        [--onnx-export DIR [DIR ...]]   # the onnx backend runs `mirrorsd export --role target` folders
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

from mirrorsd.runtime.backends import load_lm


def pass_seconds(lm, k: int, repeats: int = 5) -> float:
    """Median seconds of one pass over K+1 new positions after a 200-token context in the cache."""
    times = []
    for r in range(repeats):
        context = list(range(1000, 1200)) + list(range(5000, 5000 + 20 * r))
        lm.score(context[:-1])  # the context is in the cache; the timed pass feeds K+1 tokens
        start = time.perf_counter()
        lm.score(context, list(range(7000, 7000 + k)))
        times.append(time.perf_counter() - start)
    lm.reset()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--backends", nargs="+", default=["torch", "llamacpp"])
    ap.add_argument("--onnx-export", nargs="+", default=[], help="verifier exports of the target (onnx backend)")
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 4, 8, 16])
    args = ap.parse_args()
    rows = {}
    if "onnx" in args.backends and not args.onnx_export:
        raise SystemExit("--backends onnx needs --onnx-export DIR (mirrorsd export --role target)")
    runs = [(b, args.target) for b in args.backends if b != "onnx"]
    runs += [("onnx", d) for d in args.onnx_export if "onnx" in args.backends]
    for backend, model in runs:
        lm = load_lm(model, backend, device="cpu", progress=True).lm
        name = lm.backend if backend != "onnx" else f"{lm.backend} {Path(model).name}"
        rows[name] = [pass_seconds(lm, k) for k in args.ks]
        lm.close()
    print(f"\n{args.target}, {platform.processor() or platform.machine()}; seconds per verify pass of K drafted "
          "tokens (K+1 positions) after a 200-token context, median of 5, and in units of a plain decode step "
          "(K=0)\n")
    print("| backend | " + " | ".join(f"K={k}" for k in args.ks) + " |")
    print("|---|" + "---|" * len(args.ks))
    for name, secs in rows.items():
        print(f"| {name} | " + " | ".join(f"{s:.3f} s ({s / secs[0]:.2f})" for s in secs) + " |")


if __name__ == "__main__":
    main()
