"""Streaming: print each piece of text as soon as the target commits it."""

from __future__ import annotations

import sys

from mirrorsd import Engine, FinishEvent, GenerationConfig
from mirrorsd.apps.examples._args import parser


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    with Engine.load(target=args.target, draft=args.draft) as engine:
        pieces = 0
        for event in engine.stream("def fibonacci(n):", GenerationConfig(max_new_tokens=args.max_new_tokens)):
            sys.stdout.write(event.text)  # TokenEvent.text: the new text; FinishEvent.text: any held-back tail
            sys.stdout.flush()
            if isinstance(event, FinishEvent):
                print(f"\n[{len(event.result.token_ids)} tokens in {pieces} events, {event.result.finish_reason}]")
            else:
                pieces += 1


if __name__ == "__main__":
    main()
