"""One-shot generation: a prompt in, the whole reply out."""

from __future__ import annotations

from mirrorsd import Engine, GenerationConfig
from mirrorsd.apps.examples._args import parser


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    with Engine.load(target=args.target, draft=args.draft) as engine:
        # A string goes in as raw text; a list of {"role", "content"} messages goes through the chat template.
        result = engine.generate([{"role": "user", "content": "Write a Python function that adds two numbers."}],
                                 GenerationConfig(max_new_tokens=args.max_new_tokens))
    print(result.text)
    print(f"finish_reason={result.finish_reason} tokens={len(result.token_ids)}")


if __name__ == "__main__":
    main()
