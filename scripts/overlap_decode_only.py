"""Sequential against overlap under core pinning, end to end and without each request's first step (which
carries the prompt prefill, the same in both modes): how much of a short bench run the prefill takes, and
what the pipeline gains on decoding alone. Why: docs/pipeline.md (issue #16, the int4 draft).

    .venv/bin/python scripts/overlap_decode_only.py --prompts he.jsonl --draft DIR [--no-fallback]
        [--draft-backend torch|onnx|llamacpp] [--fresh-ab] [--limit-ab] [--target qwen2.5-coder-1.5b]
        [--max-new-tokens 64] [--rounds 2]

--fresh-ab adds the row "overlap, every step waits for K": the pipeline as it was before the request's first
step prefilled the target alone and a step after a miss verified the first fresh_k tokens, measured side by
side in the same rounds. --limit-ab adds the row "overlap, worker limit from the previous K": the pipeline as it
was before the K schedule learned from a step ahead of the worker (whose lookahead limit, 2K+1 tokens past the
committed history, then lagged one step behind a growing K), and before a step after a miss waited for one token,
not K, until costs are measured.
"""

from __future__ import annotations

import argparse
import json
import time

from contextlib import contextmanager

from mirrorsd import Engine, GenerationConfig
from mirrorsd.runtime.decode import pipeline, schedule
from mirrorsd.runtime.decode.threads import CorePins


@contextmanager
def waiting_for_k(on: bool):
    """The pipeline with every step waiting for K lookahead tokens, the first included (for the A/B row)."""
    original = pipeline._Pipeline._want
    if on:
        pipeline._Pipeline._want = lambda self, budget: budget
    try:
        yield
    finally:
        pipeline._Pipeline._want = original


@contextmanager
def stale_limit(on: bool):
    """The pipeline with the worker told each step's outcome before the K schedule learns from it, and a step
    after a miss waiting for K tokens until costs are measured (for the A/B row)."""
    learn, reconcile, init = pipeline._Pipeline.learn, pipeline._Pipeline.reconcile, schedule.CostAwareSchedule.__init__

    def deferred_learn(self, *args):
        self.deferred = args

    def reconcile_then_learn(self, outcome):
        result = reconcile(self, outcome)
        learn(self, *self.deferred)
        return result

    def fresh_k_prior_k(self, config, overlapped=False, decay=0.9):
        init(self, config, overlapped, decay)
        self.fresh_k = self.k

    if on:
        pipeline._Pipeline.learn, pipeline._Pipeline.reconcile = deferred_learn, reconcile_then_learn
        schedule.CostAwareSchedule.__init__ = fresh_k_prior_k
    try:
        yield
    finally:
        pipeline._Pipeline.learn, pipeline._Pipeline.reconcile = learn, reconcile
        schedule.CostAwareSchedule.__init__ = init


def run(engine: Engine, prompts: list, mode: str, tokens: int, outputs: list) -> tuple[float, float, float, float]:
    """(tok/s end to end, tok/s without each request's first step, draft time hidden, tokens per step); each
    prompt's tokens go to `outputs`."""
    total_n = total_s = first_n = first_s = hidden = drafting = steps = 0.0
    for messages in prompts:
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
    ap.add_argument("--fresh-ab", action="store_true", help="also overlap with every step waiting for K")
    ap.add_argument("--limit-ab", action="store_true", help="also overlap with the worker's limit from the previous K")
    ap.add_argument("--rows", default="sequential,overlap", help="which modes to run (with --fresh-ab: + the A/B row)")
    args = ap.parse_args()
    prompts = [json.loads(line)["messages"] for line in open(args.prompts) if line.strip()]
    engine = Engine.load(args.target, draft=args.draft, backend="torch", dtype="float32",
                         draft_backend=args.draft_backend)
    engine.pin_cores = CorePins.first_two()
    if args.no_fallback:
        engine = engine.with_drafter(engine.drafter, fallback=None)
    rows = ([(mode, None) for mode in args.rows.split(",")] + ([("overlap", "wait")] if args.fresh_ab else [])
            + ([("overlap", "stale")] if args.limit_ab else []))
    labels = {None: "", "wait": ", every step waits for K", "stale": ", worker limit from the previous K"}
    print(f"draft {engine.drafter.name}; pinned; {len(prompts)} prompts, {args.max_new_tokens} new tokens, greedy")
    print("| round | mode | tok/s | tok/s without each request's first step | draft hidden | tokens/step |\n"
          "|---|---|---|---|---|---|")
    reference, equal = None, True
    for r in range(args.rounds):
        for mode, variant in rows:
            outputs = []
            with waiting_for_k(variant == "wait"), stale_limit(variant == "stale"):
                total, decode, hidden, per_step = run(engine, prompts, mode, args.max_new_tokens, outputs)
            reference = reference or outputs
            equal = equal and outputs == reference
            label = mode + labels[variant]
            print(f"| {r + 1} | {label} | {total:.2f} | {decode:.2f} | {hidden:.2f} | {per_step:.2f} |", flush=True)
    print("greedy outputs: " + ("token-equal in every row" if equal else "DIFFERENT between rows (FAILED)"))


if __name__ == "__main__":
    main()
