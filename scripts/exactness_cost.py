"""What exact verify passes cost: a backend's batch-invariant configuration against its default one, side by
side in one process.

For one model: batch invariance of each (max |logit diff| of verify passes of 1..17 positions against
one-token decoding), the decode step, the verify pass over K+1 positions in decode steps of the same
configuration, and a 256-token prefill; medians of alternating rounds. Writes a markdown table.
- torch: float32 on the CPU, the default kernels (oneDNN linear, SDPA) vs the batch-invariant ones vs the
  static-shape path (every pass 16 query rows over a static cache, as on a GPU).
- onnx: ONNX Runtime's CPU provider, the export graph without the spare row (as a dynamic-profile draft is
  exported) vs the verifier's graph with it, per weight form (--quants).

    .venv/bin/python scripts/exactness_cost.py --backend torch --model smollm2-135m --out docs/results/exactness/torch-smollm2-135m.md
    .venv/bin/python scripts/exactness_cost.py --backend onnx --model smollm2-135m --out docs/results/exactness/onnx-smollm2-135m.md
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path

import torch

SIZES = (2, 4, 9, 17)


def seconds(lm, ids, n: int, base: int = 64, repeats: int = 5) -> float:
    """Median time of a pass over n positions after `base` cached ones."""
    times = []
    for _ in range(repeats):
        lm.reset()
        lm.score(ids[:base])
        t = time.perf_counter()
        lm.score(ids[:base], ids[base:base + n - 1])
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def prefill_seconds(lm, ids, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        lm.reset()
        t = time.perf_counter()
        lm.score(ids[:256])
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def torch_configs(model, tokenizer, args, work: Path) -> dict:
    from mirrorsd.runtime.backends.cpu_kernels import use_onednn_linear
    from mirrorsd.runtime.backends.torch_invariant import make_batch_invariant
    from mirrorsd.runtime.backends.torch_lm import TorchCausalLM

    from mirrorsd.runtime.backends.torch_static import StaticTorchLM

    use_onednn_linear(model)
    default = copy.deepcopy(model)
    static = StaticTorchLM(copy.deepcopy(model), "cpu", exact_batches=False)
    if not make_batch_invariant(model):
        raise SystemExit(f"the batch-invariant kernels do not apply to {args.model} here")
    return {"default (oneDNN linear, SDPA)": TorchCausalLM(default, "cpu"),
            "batch-invariant (the default)": TorchCausalLM(model, "cpu"),
            f"static shape, {static.rows} rows, {static.max_context} cells (torch-static)": static}


def onnx_configs(model, tokenizer, args, work: Path) -> dict:
    from mirrorsd.exporters import export_draft, export_target
    from mirrorsd.runtime.backends.exported import load_export_lm

    configs = {}
    for quant in args.quants:
        plain, spare = work / f"{quant}-plain", work / f"{quant}-spare"
        export_draft(copy.deepcopy(model), plain, profile="dynamic", quant=quant, max_context=1024,
                     tokenizer=tokenizer, validate=False)
        export_target(copy.deepcopy(model), spare, quant=quant, max_context=1024, tokenizer=tokenizer,
                        validate=False)
        configs[f"{quant}, no spare row"] = load_export_lm(plain, threads=args.threads)
        configs[f"{quant}, spare row (the verifier export)"] = load_export_lm(spare, threads=args.threads)
    return configs


def main() -> None:
    from mirrorsd.models import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("torch", "onnx"), default="torch")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quants", nargs="+", default=["none", "int4"], help="onnx: the export's weight forms")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, torch.device("cpu"), torch.float32, True)
    with tempfile.TemporaryDirectory(prefix="exactness-cost-") as work:  # the onnx exports
        configs = (torch_configs if args.backend == "torch" else onnx_configs)(model, tokenizer, args, Path(work))
        text = measure(configs, tokenizer, args)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


def measure(configs: dict, tokenizer, args) -> str:
    from mirrorsd.runtime.backends.invariance import check_batch_invariance

    ids = [(i * 7919 + 13) % len(tokenizer) for i in range(300)]
    prompt = tokenizer.encode("Write a Python function that reverses a string.")
    diffs = {name: check_batch_invariance(lm, prompt, offsets=(len(prompt), 280)).max_abs_diff
             for name, lm in configs.items()}
    runs: dict[tuple[str, object], list[float]] = {}
    for _ in range(args.rounds):
        for name, lm in configs.items():
            for n in (1, *SIZES):
                runs.setdefault((name, n), []).append(seconds(lm, ids, n))
            runs.setdefault((name, "prefill"), []).append(prefill_seconds(lm, ids))
    first = statistics.median(runs[(next(iter(configs)), 1)])
    where = "torch float32 on the CPU" if args.backend == "torch" else "ONNX Runtime, CPU provider"
    lines = [f"{args.model}, {where}, {args.threads} threads: verify passes at offsets "
             f"{len(prompt)} and 280 (prefix prefilled whole and in batches of 5); verify cost in decode steps of the "
             f"same configuration; medians of {args.rounds} alternating rounds in one process.", "",
             "| configuration | max \\|diff\\| batched vs one-token | decode ms | decode speed vs first row | "
             + " | ".join(f"K+1={n}" for n in SIZES) + " | prefill 256 tokens, ms |",
             "|---|---|---|---|" + "---|" * len(SIZES) + "---|"]
    for name in configs:
        decode = statistics.median(runs[(name, 1)])
        diff = "**0 (exact)**" if diffs[name] == 0 else f"{diffs[name]:.2g}"
        costs = " | ".join(f"{statistics.median(runs[(name, n)]) / decode:.2f}" for n in SIZES)
        lines.append(f"| {name} | {diff} | {decode * 1e3:.1f} | {first / decode:.3f}x | {costs} | "
                     f"{statistics.median(runs[(name, 'prefill')]) * 1e3:.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
