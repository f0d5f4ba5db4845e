"""Greedy agreement of model backends with llama.cpp on the same GGUF: target-only continuations of the
bench prompts (greedy ones), per backend, against llama.cpp's; where one diverges, llama.cpp's top-2 logit
gap at that position (a near-tie or not). Also each backend's target-only tokens/s on those prompts.
Why: an ONNX Runtime export either carries the GGUF's blocks (--quant gguf) or requantizes them
(--quant int4); this measures how close each decodes to the file llama.cpp runs (docs/backends.md).

    .venv/bin/python scripts/backend_agreement.py --onnx-export /tmp/vx/q15-gguf /tmp/vx/q15-int4 \
        [--target qwen2.5-coder-1.5b] [--per-category 2] [--tokens 64]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from mirrorsd import Engine, GenerationConfig
from mirrorsd.apps.bench.prompt_suite import bundled_suite


def continuations(engine: Engine, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], float]:
    """Greedy target-only continuations and the tokens/s over all of them."""
    engine.eos_ids = frozenset()  # full length everywhere, so every position is compared
    outs, n, seconds = [], 0, 0.0
    for ids in prompts:
        start = time.perf_counter()
        out = engine.generate(ids, GenerationConfig(max_new_tokens=tokens)).token_ids
        seconds += time.perf_counter() - start
        outs.append(out)
        n += len(out)
    return outs, n / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--onnx-export", nargs="+", default=[], help="verifier exports of the target")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    reference = Engine.load(args.target, draft=None, backend="llamacpp")
    suite = [p for p in bundled_suite(args.per_category) if p.greedy and p.json_schema is None]
    prompts = [reference.encode(p.request) for p in suite]
    ref_outs, ref_rate = continuations(reference.with_drafter(None), prompts, args.tokens)
    print(f"\n{args.target}: {len(prompts)} greedy bench prompts, {args.tokens} tokens each, target only; "
          f"reference: llama.cpp on the GGUF ({ref_rate:.2f} tok/s)\n")
    print("| backend | tok/s | identical continuations | tokens before the first divergence (per prompt) "
          "| llama.cpp's top-2 gap at each divergence |")
    print("|---|---|---|---|---|")
    for folder in args.onnx_export:
        engine = Engine.load(folder, draft=None)
        outs, rate = continuations(engine.with_drafter(None), prompts, args.tokens)
        engine.close()
        same, firsts, gaps = 0, [], []
        for ids, ref, out in zip(prompts, ref_outs, outs):
            first = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), None)
            if first is None:
                same += 1
                firsts.append(str(len(ref)))
                continue
            firsts.append(str(first))
            logits = reference.target.score(ids + ref[:first])[-1].float()
            top = logits.topk(2).values
            gaps.append(f"{(top[0] - top[1]).item():.3f}")
            reference.target.reset()
        print(f"| onnx {Path(folder).name} | {rate:.2f} | {same}/{len(prompts)} | {' '.join(firsts)} "
              f"| {' '.join(gaps) or '-'} |")


if __name__ == "__main__":
    main()
