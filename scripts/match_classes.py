"""Per-token acceptance of model-free drafts by match length: the table behind runtime/decode/match_classes.py.

The target decodes the bench suite's greedy prompts (json-schema ones left out) once; each drafter then replays
those answers (greedy speculative decoding commits exactly them: propose up to K, keep the matching prefix,
advance) and every draft is counted under its (source, match length) class. Writes table.md into --out.

    .venv/bin/python scripts/match_classes.py --model qwen2.5-coder-1.5b --out docs/match-classes/qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

from mirrorsd import Engine, GenerationConfig
from mirrorsd.apps.prompt_suite import bundled_suite
from mirrorsd.drafters import make_drafter
from mirrorsd.runtime.decode.match_classes import LONGEST_CLASS


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("-k", type=int, default=8, help="draft tokens asked for per step")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    engine = Engine.load(target=args.model, draft=None)
    runs = answers(engine, args.per_category, args.max_new_tokens)
    lines = [f"{args.model}: greedy answers to {len(runs)} bench prompts ({args.max_new_tokens} new tokens at most), "
             f"replayed at K = {args.k}; alpha = accepted / draft positions reached.", "",
             "| drafter | match length | drafts | alpha | accepted per draft |", "|---|---|---|---|---|"]
    for name in ("ngram", "retrieval"):
        counts = replay(make_drafter(name, engine.tokenizer), runs, args.k)
        for length, (drafts, reached, accepted) in sorted(counts.items()):
            label = f"{length}+" if length == LONGEST_CLASS else str(length)
            lines.append(f"| {name} | {label} | {drafts} | {accepted / reached:.2f} | {accepted / drafts:.2f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
