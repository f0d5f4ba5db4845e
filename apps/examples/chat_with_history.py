"""A multi-turn chat: keep the messages, append each reply, send the whole history every turn."""

from __future__ import annotations

from mirrorsd import Engine, GenerationConfig
from mirrorsd.apps.examples._args import parser


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=0.7, seed=0)
    messages = [{"role": "system", "content": "You are a concise assistant."}]
    with Engine.load(target=args.target, draft=args.draft) as engine:
        for question in ("What is a list comprehension in Python?", "Show me one."):
            messages.append({"role": "user", "content": question})
            reply = engine.generate(messages, config)
            messages.append({"role": "assistant", "content": reply.text})
            print(f"user: {question}\nassistant: {reply.text}\n")
    print(f"history: {len(messages)} messages")


if __name__ == "__main__":
    main()
