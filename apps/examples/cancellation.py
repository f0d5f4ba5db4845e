"""Cancellation: stop a reply early, from the consuming loop or from another thread.

Closing the stream (leaving the for loop and calling close(), or a `with contextlib.closing(...)`)
cancels the request at once: no more verify steps run and the Engine is free for the next one.
"""

from __future__ import annotations

import contextlib
import threading

from mirrorsd import Engine, FinishEvent, GenerationConfig
from mirrorsd.apps.examples._args import parser


def main(argv: list[str] | None = None) -> None:
    args = parser(__doc__).parse_args(argv)
    config = GenerationConfig(max_new_tokens=max(args.max_new_tokens, 32))
    with Engine.load(target=args.target, draft=args.draft) as engine:
        # 1. From the loop: keep the first 5 tokens, then close the stream.
        with contextlib.closing(engine.stream("Count from one to one hundred:", config)) as stream:
            first = [event.token_id for event, _ in zip(stream, range(5))]
        print(f"kept {len(first)} tokens, then closed the stream")

        # 2. From another thread (a Stop button, a timeout): set an Event the loop checks. Here a
        #    "user" thread presses stop as soon as the reply starts showing.
        stop, started = threading.Event(), threading.Event()
        threading.Thread(target=lambda: (started.wait(), stop.set()), daemon=True).start()
        tokens = 0
        stream = engine.stream("Count from one to one hundred:", config)
        try:
            for event in stream:
                if isinstance(event, FinishEvent):
                    print(f"finished before the stop arrived ({event.result.finish_reason})")
                    break
                tokens += 1
                started.set()
                if stop.is_set():
                    print(f"stopped from another thread after {tokens} tokens")
                    break
        finally:
            stream.close()

        # The engine is free again at once.
        again = engine.generate("Count from one to one hundred:", GenerationConfig(max_new_tokens=3))
        print(f"next request: {len(again.token_ids)} tokens, {again.finish_reason}")


if __name__ == "__main__":
    main()
