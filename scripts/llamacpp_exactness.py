"""llama.cpp configurations side by side in one process: batch invariance, decode speed, verify-cost curve.

For each configuration (ggml's batch-invariant mode on/off, flash attention on/off, weight repacking
on/off) this loads the GGUF once, checks batch invariance (runtime/backends/invariance.py: passes of
1..17 positions at two cache offsets, the prefix prefilled in one batch and in batches of 5), then times
one-token decoding and verify passes of K+1 = 2..17 positions with logits at every row, in rounds that
alternate between the configurations so that drift on the machine hits them all alike.

    .venv/bin/python scripts/llamacpp_exactness.py --model qwen2.5-coder-1.5b --out docs/results/exactness/qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from mirrorsd.models import resolve_gguf
from mirrorsd.runtime.backends.ggml_kernels import batch_invariant_switch
from mirrorsd.runtime.backends.invariance import check_batch_invariance, greedy_tokens
from mirrorsd.runtime.backends.llamacpp_lm import LlamaCppLM

CONFIGS = {  # name -> LlamaCppLM options
    "stock (llama-cpp-python defaults)": dict(exact=False, flash_attn=False, repack=True),
    "stock + flash attention": dict(exact=False, flash_attn=True, repack=True),
    "stock + flash attention, repack off": dict(exact=False, flash_attn=True, repack=False),
    "batch-invariant, flash attention off": dict(exact=True, flash_attn=False, repack=True),
    "batch-invariant + flash attention, repack off": dict(exact=True, flash_attn=True, repack=False),
    "batch-invariant + flash attention (default)": dict(exact=True, flash_attn=True, repack=True),
}
PROMPT = ("<|im_start|>user\nWrite a Python function that checks whether a string is a palindrome, "
          "with a docstring and two examples.<|im_end|>\n<|im_start|>assistant\n")


def decode_ms(lm, tokens: list[int], start: int, n: int) -> float:
    """Median time of one-token steps over tokens[start:start + n] (the cache holds tokens[:start])."""
    lm.reset()
    lm.score(tokens[:start])
    times = []
    for p in range(start, start + n):
        t = time.perf_counter()
        lm.score(tokens[:p + 1])
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def verify_ms(lm, tokens: list[int], start: int, k: int, reps: int) -> float:
    """Median time of a pass over K+1 positions (the last committed token and K drafted ones)."""
    lm.reset()
    lm.score(tokens[:start])
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        lm.score(tokens[:start + 1], tokens[start + 1:start + 1 + k])
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def prefill_ms(lm, tokens: list[int], n: int, reps: int) -> float:
    """Median time of scoring tokens[:n] from an empty cache (a prompt's prefill)."""
    times = []
    for _ in range(reps):
        lm.reset()
        t = time.perf_counter()
        lm.score(tokens[:n])
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="catalog name or .gguf file")
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), help="names from CONFIGS")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--max-k", type=int, default=16)
    ap.add_argument("--prefill", type=int, default=256, help="prompt length whose prefill is timed")
    ap.add_argument("--long-offset", type=int, default=300, help="a cache offset past 256 (ggml's KV padding)")
    ap.add_argument("--out", type=Path, default=None, help="folder for results.json and table.md")
    args = ap.parse_args()
    if batch_invariant_switch() is None:
        raise SystemExit("this llama-cpp-python build lacks the batch-invariant patch (scripts/setup.sh builds it)")

    gguf, tokenizer_dir = resolve_gguf(args.model, progress=True)
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(tokenizer_dir)(PROMPT)["input_ids"]
    lms = {name: LlamaCppLM(gguf, **CONFIGS[name]) for name in args.configs}
    first = next(iter(lms.values()))
    tokens = greedy_tokens(first, prompt, args.long_offset + 20 - len(prompt))
    results = {name: {"options": CONFIGS[name]} for name in lms}
    for name, lm in lms.items():
        report = check_batch_invariance(lm, tokens, offsets=(len(prompt), args.long_offset))
        results[name]["invariance"] = {"max_abs_diff": report.max_abs_diff, "by_size": report.by_size}
        print(f"{name}: {report.summary()}", flush=True)
    ks = list(range(1, args.max_k + 1))
    samples = {name: {"decode": [], "prefill": [], **{k: [] for k in ks}} for name in lms}
    for r in range(args.rounds):
        for name, lm in lms.items():
            samples[name]["decode"].append(decode_ms(lm, tokens, len(prompt), args.decode_tokens))
            for k in ks:
                samples[name][k].append(verify_ms(lm, tokens, len(prompt), k, reps=3))
            samples[name]["prefill"].append(prefill_ms(lm, tokens, args.prefill, reps=2))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    stock = statistics.median(samples[args.configs[0]]["decode"])
    for name in lms:
        dec = statistics.median(samples[name]["decode"])
        results[name]["decode_ms"] = round(dec, 2)
        results[name]["decode_vs_first"] = round(stock / dec, 3)
        results[name]["verify_steps"] = {k: round(statistics.median(samples[name][k]) / dec, 2) for k in ks}
        results[name]["prefill_ms"] = round(statistics.median(samples[name]["prefill"]), 1)
    table = render(results, args, ks, len(prompt))
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"model": args.model, "results": results}, indent=1))
        (args.out / "table.md").write_text(table)


def render(results: dict, args, ks: list[int], prompt_len: int) -> str:
    shown = [k for k in ks if k in (1, 2, 3, 4, 6, 7, 8, 12, 16)]
    head = ("| configuration | max \\|diff\\| batched vs one-token | decode ms | decode speed vs first row | "
            + " | ".join(f"K+1={k + 1}" for k in shown) + f" | prefill {args.prefill} tokens, ms |")
    lines = [f"{args.model}: passes of 1..17 positions at offsets {prompt_len} and {args.long_offset}, prefix "
             "prefilled whole and in batches of 5; verify cost in decode steps (logits at every row); "
             f"medians of {args.rounds} alternating rounds in one process.", "", head,
             "|" + "---|" * (5 + len(shown))]
    for name, r in results.items():
        diff = r["invariance"]["max_abs_diff"]
        lines.append(f"| {name} | {'**0 (exact)**' if diff == 0 else f'{diff:.3g}'} | {r['decode_ms']} | "
                     f"{r['decode_vs_first']:.3f}x | " + " | ".join(str(r["verify_steps"][k]) for k in shown)
                     + f" | {r['prefill_ms']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
