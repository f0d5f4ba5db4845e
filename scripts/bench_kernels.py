"""Verify-pass time by draft length K, default float32 linear (MKL) vs oneDNN, at 1 and 2 threads.

The measurement behind runtime/cpu_kernels.py and the pipeline's `auto` rule: one target model, a
200-token context in its KV cache, then a pass over K+1 new tokens (what verifying K drafted tokens
costs), median of 3. Everything is measured side by side in one run.

    .venv/bin/python scripts/bench_kernels.py [--target qwen2.5-coder-1.5b] [--ks 0 1 2 4 8]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from mirrorsd.devices import resolve_device
from mirrorsd.models import load_model
from mirrorsd.runtime.backends.cpu_kernels import use_onednn_linear
from mirrorsd.runtime.backends.torch_lm import TorchCausalLM


def pass_seconds(lm: TorchCausalLM, k: int, repeats: int = 3) -> float:
    times = []
    for r in range(repeats):
        context = list(range(1000, 1200)) + list(range(5000, 5000 + 20 * r))
        lm.score(context[:-1], [])  # the context is in the cache; the timed pass feeds K+1 tokens
        start = time.perf_counter()
        lm.score(context, list(range(7000, 7000 + k)))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    args = ap.parse_args()
    model, _ = load_model(args.target, resolve_device("cpu"), torch.float32, progress=True)
    lm = TorchCausalLM(model)
    cores = torch.get_num_threads()
    threads = sorted({1, cores})
    rows = {}
    for kernel in ("default", "onednn"):
        if kernel == "onednn" and not use_onednn_linear(model):
            print("oneDNN linear is not usable with this torch build")
            break
        for n in threads:
            torch.set_num_threads(n)
            rows[(kernel, n)] = [pass_seconds(lm, k) for k in args.ks]
    torch.set_num_threads(cores)
    print(f"\n{args.target} float32, {platform.processor() or platform.machine()}, torch {torch.__version__}; "
          f"seconds per verify pass of K drafted tokens (K+1 positions), median of 3\n")
    print("| linear kernel | threads | " + " | ".join(f"K={k}" for k in args.ks) + " | K=" + str(args.ks[-1])
          + " / plain |")
    print("|---|---|" + "---|" * (len(args.ks) + 1))
    for (kernel, n), secs in rows.items():
        name = "F.linear (MKL)" if kernel == "default" else "oneDNN"
        print(f"| {name} | {n} | " + " | ".join(f"{s:.3f}" for s in secs) + f" | {secs[-1] / secs[0]:.2f}x |")
    base = rows.get(("default", cores))
    fast = rows.get(("onednn", cores))
    if base and fast:
        print(f"\noneDNN over F.linear at {cores} threads: " +
              ", ".join(f"K={k} {b / f:.2f}x" for k, b, f in zip(args.ks, base, fast)))
    if ("onednn", 1) in rows and fast and cores > 1:
        one = rows[("onednn", 1)]
        print(f"oneDNN, 1 thread against {cores}: " + ", ".join(f"K={k} {o / f:.2f}x as long"
                                                             for k, o, f in zip(args.ks, one, fast)))


if __name__ == "__main__":
    main()
