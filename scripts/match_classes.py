"""Per-token acceptance of model-free drafts by match length: the table behind runtime/decode/policy/match_classes.py.

The target decodes the bench suite's greedy prompts (json-schema ones left out) once; each drafter then replays
those answers (greedy speculative decoding commits exactly them: propose up to K, keep the matching prefix,
advance) and every draft is counted under its (source, match length) class. Writes table.md into --out.
With --ab, instead: each drafter decodes the prompts as it is and with one choice undone (--variant: the cut per
match class, StepPolicy.fit; the gate weighing every step that asked for a draft; bounded drafters on the request's
thread), interleaved in one process, and ab.md (ab-VARIANT.md) gets per-category speedups over target-only decoding
(medians of the repeats, seconds per generated token after the prompt).

    .venv/bin/python scripts/match_classes.py --model qwen2.5-coder-1.5b --out docs/results/match-classes/qwen2.5-coder-1.5b
    .venv/bin/python scripts/match_classes.py --model smollm2-135m --ab --repeats 3 --out docs/results/match-classes/smollm2-135m
    .venv/bin/python scripts/match_classes.py --model qwen2.5-coder-1.5b --ab --variant "gate on verified drafts" \
        --categories chat summarisation json --out docs/results/match-classes/qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import collections
import statistics
from pathlib import Path

from mirrorsd import Engine, GenerationConfig
from mirrorsd.apps.bench.prompt_suite import bundled_suite
from mirrorsd.drafters import make_drafter
from mirrorsd.runtime.decode.policy.match_classes import LONGEST_CLASS


def answers(engine: Engine, per_category: int, tokens: int) -> list[tuple[str, list[int], list[int]]]:
    out = []
    for prompt in bundled_suite(per_category):
        if prompt.json_schema is None:
            engine.reset()
            result = engine.generate(prompt.request, GenerationConfig(max_new_tokens=tokens))
            out.append((prompt.category, engine.encode(prompt.request), list(result.token_ids)))
    return out


def replay(drafter, runs, k: int) -> dict[int, list[int]]:
    """match class -> [drafts, positions reached, accepted tokens]."""
    counts: dict[int, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for _, prompt, target in runs:
        drafter.start(GenerationConfig(max_new_tokens=max(1, len(target))))
        pos = 0
        while pos < len(target):
            budget = min(k, len(target) - pos - 1)
            draft = drafter.propose(prompt + target[:pos], budget) if budget > 0 else None
            tokens = list(draft.tokens[:budget]) if draft is not None else []
            n = 0
            while n < len(tokens) and tokens[n] == target[pos + n]:
                n += 1
            if tokens:
                c = counts[min(draft.match, LONGEST_CLASS)]
                c[0], c[1], c[2] = c[0] + 1, c[1] + min(n + 1, len(tokens)), c[2] + n
            pos += n + 1
            drafter.accepted(prompt + target[:pos], n)
    return counts


def without(variant: str):
    """Undo one choice for a run: (the class that holds it, its member, the stand-in)."""
    from mirrorsd.runtime.decode import drafting
    from mirrorsd.runtime.decode.policy.step_policy import StepPolicy

    if variant == "uncut":
        return StepPolicy, "fit", lambda self, draft, whole=False: draft
    if variant == "gate on verified drafts":
        learn = StepPolicy.learn

        def learn_verified(self, n_drafted, *args, **kwargs):
            self._asked = n_drafted > 0
            return learn(self, n_drafted, *args, **kwargs)
        return StepPolicy, "learn", learn_verified
    if variant == "drafting thread":
        return drafting, "_caller_for", lambda drafter, core: None if drafter is None else drafting._Caller(core)
    raise ValueError(variant)


VARIANTS = {"uncut": "every model-free draft verified as proposed",
            "gate on verified drafts": "the gate counts a step as drafting only if it verified a draft",
            "drafting thread": "the drafter runs on a drafting thread"}
"""--ab --variant: the choice undone, and what the run does instead."""


def ab(engine: Engine, prompts, drafters: list[str], tokens: int, repeats: int, variant: str = "uncut") -> list[str]:
    """Per-category speedup over target-only of each drafter as it is and with one choice undone (`without`)."""
    holder, member, stand_in = without(variant)
    kept = holder.__dict__[member]
    rows = ["none"] + [f"{d}{tag}" for d in drafters for tag in ("", f" ({variant})")]
    engines = {r: engine if r == "none" else engine.with_drafter(r.split()[0]) for r in rows}

    def run(row, prompt, n):
        setattr(holder, member, stand_in if row.endswith(f"({variant})") else kept)
        try:
            engine.reset()
            return engines[row].generate(prompt.request, GenerationConfig(
                max_new_tokens=n, temperature=prompt.temperature, top_p=prompt.top_p)).stats
        finally:
            setattr(holder, member, kept)

    for row in rows:  # warm up: the verify curve, first calls
        run(row, prompts[0], 8)
    seconds = collections.defaultdict(list)
    for rep in range(repeats):
        for prompt in prompts:
            for row in rows[rep % len(rows):] + rows[:rep % len(rows)]:
                s = run(row, prompt, tokens)
                seconds[prompt.label, row].append((s.total_time_s - s.prompt_time_s) / max(s.generated_tokens - 1, 1))
    per = collections.defaultdict(lambda: collections.defaultdict(float))  # category -> row -> seconds
    for prompt in prompts:
        for row in rows:
            for cat in (prompt.category, "all"):
                per[cat][row] += statistics.median(seconds[prompt.label, row])
    cats = [c for c in per if c != "all"] + ["all"]
    lines = ["| configuration | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
    for row in rows[1:]:
        lines.append(f"| {row} | " + " | ".join(f"{per[c]['none'] / per[c][row]:.2f}x" for c in cats) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("-k", type=int, default=8, help="draft tokens asked for per step")
    parser.add_argument("--ab", action="store_true", help="time decoding as it is and with one choice undone")
    parser.add_argument("--variant", choices=VARIANTS, default="uncut",
                        help="--ab: the choice undone; " + "; ".join(f"{k}: {v}" for k, v in VARIANTS.items()))
    parser.add_argument("--categories", nargs="*", help="only these categories (--ab)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per prompt and configuration (--ab)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    engine = Engine.load(target=args.model, draft=None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.ab:
        prompts = [p for p in bundled_suite(args.per_category)
                   if p.json_schema is None and (not args.categories or p.category in args.categories)]
        lines = [f"{args.model}: tok/s over target-only decoding, {len(prompts)} bench prompts, {args.max_new_tokens} "
                 f"new tokens at most, medians of {args.repeats} interleaved runs in one process; ({args.variant}): "
                 f"{VARIANTS[args.variant]}.", "", *ab(engine, prompts, ["ngram", "chain"], args.max_new_tokens, args.repeats,
                                     args.variant)]
        name = "ab.md" if args.variant == "uncut" else f"ab-{args.variant.replace(' ', '-')}.md"
        (out / name).write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return
    runs = answers(engine, args.per_category, args.max_new_tokens)
    lines = [f"{args.model}: greedy answers to {len(runs)} bench prompts ({args.max_new_tokens} new tokens at most), "
             f"replayed at K = {args.k}; alpha = accepted / draft positions reached.", "",
             "| drafter | match length | drafts | alpha | accepted per draft |", "|---|---|---|---|---|"]
    for name in ("ngram", "retrieval"):
        counts = replay(make_drafter(name, engine.tokenizer), runs, args.k)
        for length, (drafts, reached, accepted) in sorted(counts.items()):
            label = f"{length}+" if length == LONGEST_CLASS else str(length)
            lines.append(f"| {name} | {label} | {drafts} | {accepted / reached:.2f} | {accepted / drafts:.2f} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
