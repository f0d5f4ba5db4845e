"""Greedy divergences from target-only decoding, counted: every drafter x pipeline mode on one target.

Runs the bench suite's greedy prompts (json-schema ones under their schema) with each drafter in each
mode and compares the tokens with the same engine's target-only decoding, token for token. Exit status 1
on any divergence. Prints one line per drafter x mode and a summary table (markdown).

    .venv/bin/python scripts/exactness_sweep.py --target qwen2.5-coder-1.5b --draft-model qwen2.5-coder-0.5b \\
        --max-new-tokens 96 --out docs/results/exactness/sweep-qwen2.5-coder-1.5b.md
    .venv/bin/python scripts/exactness_sweep.py --target smollm2-135m --max-new-tokens 512 --prompts 4
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from mirrorsd import Engine, GenerationConfig
from mirrorsd.apps.bench.prompt_suite import bundled_suite

MODES = ("off", "overlap", "branches")


def drafters(engine: Engine, target: str, draft_model: str | None, backend: str) -> dict:
    """name -> factory of a fresh drafter."""
    from mirrorsd.runtime.drafters import ModelDrafter
    from mirrorsd.runtime.drafters.factory import make_drafter
    from mirrorsd.runtime.backends import load_lm

    made = {"ngram": lambda: make_drafter("ngram", engine.tokenizer, target),
            "retrieval": lambda: make_drafter("retrieval", engine.tokenizer, target),
            "chain": lambda: make_drafter("chain", engine.tokenizer, target),
            "self": lambda: ModelDrafter(load_lm(target, backend).lm)}
    if draft_model:
        made["draft model"] = lambda: make_drafter(draft_model, engine.tokenizer, target, backend=backend)
    return made


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--draft-model", default=None, help="a draft model for the 'draft model' rows")
    ap.add_argument("--drafters", nargs="*", default=None, help="subset of: ngram retrieval chain self 'draft model'")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=None, help="only the first N greedy prompts")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=None, help="write the summary table here (markdown)")
    args = ap.parse_args()

    engine = Engine.load(target=args.target, draft="none", backend=args.backend, progress=True)
    prompts = [p for p in bundled_suite(args.per_category) if p.greedy][:args.prompts]
    factories = drafters(engine, args.target, args.draft_model, args.backend)
    names = args.drafters or list(factories)
    reference = {}
    for p in prompts:
        engine.drafter = None
        engine.reset()
        reference[p.label] = engine.generate(p.request, GenerationConfig(max_new_tokens=args.max_new_tokens,
                                                                         json_schema=p.json_schema)).token_ids
    rows, divergent = [], 0
    for name in names:
        engine.drafter = factories[name]()
        for mode in MODES:
            start, differ, drafted, accepted = time.perf_counter(), [], 0, 0
            for p in prompts:
                engine.reset()
                result = engine.generate(p.request, GenerationConfig(max_new_tokens=args.max_new_tokens,
                                                                     json_schema=p.json_schema, pipeline=mode))
                drafted += result.stats.drafted_tokens
                accepted += result.stats.accepted_tokens
                if result.token_ids != reference[p.label]:
                    differ.append(p.label)
            divergent += len(differ)
            rows.append((name, mode, len(prompts), len(differ), drafted, accepted, time.perf_counter() - start))
            print(f"{name}, {mode}: {len(differ)} of {len(prompts)} prompts differ {differ or ''} "
                  f"(drafted {drafted}, accepted {accepted})", flush=True)
        close = getattr(engine.drafter, "close", None)
        if close is not None:
            close()
    table = "\n".join([
        f"{Path(args.target).name} on {engine.target.backend} (exact_batches {engine.target.exact_batches}), "
        f"{len(prompts)} greedy prompts of the bench suite, {args.max_new_tokens} new tokens"
        + (f"; draft model {Path(args.draft_model).name}" if args.draft_model else "") + ":", "",
        "| drafter | mode | prompts | differing from target-only | drafted | accepted |",
        "|---|---|---|---|---|---|",
        *(f"| {n} | {m} | {k} | {d} | {dr} | {ac} |" for n, m, k, d, dr, ac, _ in rows)]) + "\n"
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)
    return 1 if divergent else 0


if __name__ == "__main__":
    sys.exit(main())
