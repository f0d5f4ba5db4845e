"""One Engine, several threads: requests are serialized (a lock inside the Engine), not batched, so
each thread gets exactly the reply it would get alone; the others wait their turn."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from mirrorsd import Engine, GenerationConfig
from mirrorsd.apps.examples._args import parser


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    prompts = ["def add(a, b):", "import os", "class Stack:", "for i in range(3):"]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    with Engine.load(target=args.target, draft=args.draft) as engine:
        with ThreadPoolExecutor(max_workers=4) as pool:
            results = list(pool.map(lambda p: engine.generate(p, config), prompts))
        alone = [engine.generate(p, config) for p in prompts]
    for prompt, r, a in zip(prompts, results, alone):
        print(f"{prompt!r}: {len(r.token_ids)} tokens, same as alone: {r.token_ids == a.token_ids}")


if __name__ == "__main__":
    main()
