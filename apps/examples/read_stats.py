"""Reading statistics: how much speculation helped one request.

GenerationStats is a frozen dataclass; `to_dict()` gives every field (including any added later), the
properties give the derived numbers.
"""

from __future__ import annotations

import json

from mirrorsd import Engine, GenerationConfig
from mirrorsd.apps.examples._args import parser


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    with Engine.load(target=args.target, draft=args.draft) as engine:
        prompt = [{"role": "user", "content": "Repeat after me: the quick brown fox jumps over the lazy dog."}]
        result = engine.generate(prompt, GenerationConfig(max_new_tokens=args.max_new_tokens))
    s = result.stats
    alpha = "n/a (nothing drafted)" if s.acceptance_rate is None else f"{s.acceptance_rate:.0%}"
    print(f"tokens/s: {s.tokens_per_second:.1f}")
    print(f"acceptance rate: {alpha}")
    print(f"mean accepted length: {s.mean_accepted_length:.2f} tokens per verify step")
    print(f"drafter: {s.drafter} (steps per source: {s.drafters})")
    print(f"draft time {s.draft_time_s * 1000:.1f} ms, verify time {s.verify_time_s * 1000:.1f} ms")
    print(f"draft-accepted tokens: {sum(result.from_draft)} of {len(result.token_ids)}")
    print(json.dumps(s.to_dict()))


if __name__ == "__main__":
    main()
