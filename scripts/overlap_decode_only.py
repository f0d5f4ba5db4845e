"""Sequential against overlap under core pinning, end to end and without each request's first step (which
carries the prompt prefill, the same in both modes): how much of a short bench run the prefill takes, and
what the pipeline gains on decoding alone. Why: docs/pipeline.md (the int4 draft).

    .venv/bin/python scripts/overlap_decode_only.py --prompts he.jsonl --draft DIR [--no-fallback]
        [--draft-backend torch|onnx|llamacpp] [--target qwen2.5-coder-1.5b] [--max-new-tokens 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import time

from mirrorsd import Engine, GenerationConfig
from mirrorsd.runtime.decode.pipeline.threads import CoreLayout


def run(engine: Engine, prompts: list, mode: str, tokens: int, outputs: list) -> tuple[float, float, float, float]:
    """(tok/s end to end, tok/s without each request's first step, draft time hidden, tokens per step); each
    prompt's tokens go to `outputs`."""
    total_n = total_s = first_n = first_s = hidden = drafting = steps = 0.0
    for messages in prompts:
        engine.reset()  # a cold start: no prompt prefix kept from the run before
        start = time.perf_counter()
        result = engine.generate(messages, GenerationConfig(max_new_tokens=tokens, pipeline=mode))
        total_s += time.perf_counter() - start
        outputs.append(result.token_ids)
        total_n += len(result.token_ids)
        first = min((s for s in result.spans if s.lane == "verify"), key=lambda s: s.start)
        first_s += first.start + first.seconds  # from the request's start: its first draft and the prefill
        first_n += (first.accepted or 0) + 1
        hidden, drafting = hidden + result.stats.draft_hidden_s, drafting + result.stats.draft_time_s
        steps += result.stats.verify_steps
    return total_n / total_s, (total_n - first_n) / (total_s - first_s), hidden / max(drafting, 1e-9), total_n / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", required=True, help="JSONL of {\"messages\": [...]}")
    ap.add_argument("--draft", required=True, help="the draft: an export folder or a model")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-fallback", action="store_true", help="no inline n-gram drafts in the pipeline")
    ap.add_argument("--draft-backend", default=None, help="the draft model's backend (default: auto)")
    ap.add_argument("--rows", default="off,overlap", help="which modes to run")
    args = ap.parse_args()
    prompts = [json.loads(line)["messages"] for line in open(args.prompts) if line.strip()]
    engine = Engine.load(args.target, draft=args.draft, backend="torch", dtype="float32",
                         draft_backend=args.draft_backend)
    engine.cores = CoreLayout.first_two()
    if args.no_fallback:
        engine = engine.with_drafter(engine.drafter, helper=None)
    print(f"draft {engine.drafter.name}; pinned; {len(prompts)} prompts, {args.max_new_tokens} new tokens, greedy")
    print("| round | mode | tok/s | tok/s without each request's first step | draft hidden | tokens/step |\n"
          "|---|---|---|---|---|---|")
    reference, equal = None, True
    for r in range(args.rounds):
        for mode in args.rows.split(","):
            outputs = []
            total, decode, hidden, per_step = run(engine, prompts, mode, args.max_new_tokens, outputs)
            reference = reference or outputs
            equal = equal and outputs == reference
            print(f"| {r + 1} | {mode} | {total:.2f} | {decode:.2f} | {hidden:.2f} | {per_step:.2f} |", flush=True)
    print("greedy outputs: " + ("token-equal in every row" if equal else "DIFFERENT between rows (FAILED)"))


if __name__ == "__main__":
    main()
