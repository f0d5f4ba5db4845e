"""Sequential against overlap under core pinning, end to end and without each request's first step (which
carries the prompt prefill, the same in both modes): how much of a short bench run the prefill takes, and
what the pipeline gains on decoding alone. Why: docs/pipeline.md (issue #16, the int4 draft).

    .venv/bin/python scripts/overlap_decode_only.py --prompts he.jsonl --draft DIR [--no-fallback]
        [--draft-backend torch|onnx|llamacpp] [--fresh-ab] [--before-ab] [--target qwen2.5-coder-1.5b]
        [--max-new-tokens 64] [--rounds 2]

--fresh-ab adds the row "overlap, every step waits for K": the pipeline as it was before the request's first
step prefilled the target alone and a step after a miss verified the first fresh_k tokens, measured side by
side in the same rounds. --before-ab adds, after each pipeline mode in --rows, that mode "with the lookahead
as before" the changes of 2026-12-01 that keep the worker's lookahead ahead of the verifier (lookahead_as_before).
"""

from __future__ import annotations

import argparse
import json
import time

from contextlib import contextmanager

from mirrorsd import Engine, GenerationConfig
from mirrorsd.runtime.decode import pipeline, schedule, worker
from mirrorsd.runtime.decode.branches import BranchPlan
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
def lookahead_as_before(on: bool):
    """The pipeline's lookahead as it was before four changes, for the A/B rows: the worker heard where a step
    landed before the K schedule learned from it (its limit, 2K+1 tokens past the committed history, then
    lagged one step behind a growing K); a step after a miss waited for K tokens until costs were measured; the
    worker's limit while the target prefilled alone was set for the starting K; and a branch plan scored the
    lookahead 0 when the step verified all of it (the worker then drafted branches before the next draft)."""
    learn, reconcile = pipeline._Pipeline.learn, pipeline._Pipeline.reconcile
    init, rebase, plan = schedule.CostAwareSchedule.__init__, pipeline.Rebase, worker.plan_branches
    start_k = GenerationConfig().num_draft_tokens

    def deferred_learn(self, *args):
        self.deferred = args

    def reconcile_then_learn(self, outcome):
        result = reconcile(self, outcome)
        learn(self, *self.deferred)
        return result

    def fresh_k_prior_k(self, config, overlapped=False, decay=0.9):
        init(self, config, overlapped, decay)
        self.fresh_k = self.k

    def start_limit_from_k(epoch, committed, ahead, limit, n_accepted):
        at_start = n_accepted is None  # the request's first message
        return rebase(epoch, committed, ahead, len(committed) + 2 * start_k + 1 if at_start else limit, n_accepted)

    def lookahead_zero_without_bonus_row(hint, seq, token_seconds, now):
        result = plan(hint, seq, token_seconds, now)
        k, base = len(hint.draft), hint.base_len
        guessed = len(seq) > base + k and seq[base:base + k] == list(hint.draft)
        return result if guessed and len(hint.top_ids) > k else BranchPlan(result.branches, 0.0)

    def install(functions) -> None:
        (pipeline._Pipeline.learn, pipeline._Pipeline.reconcile, schedule.CostAwareSchedule.__init__,
         pipeline.Rebase, worker.plan_branches) = functions

    originals = (learn, reconcile, init, rebase, plan)
    if on:
        install((deferred_learn, reconcile_then_learn, fresh_k_prior_k, start_limit_from_k,
                 lookahead_zero_without_bonus_row))
    try:
        yield
    finally:
        install(originals)


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
    ap.add_argument("--fresh-ab", action="store_true", help="also overlap with every step waiting for K")
    ap.add_argument("--before-ab", action="store_true", help="also each pipeline mode with the lookahead as before")
    ap.add_argument("--rows", default="sequential,overlap", help="which modes to run (with --fresh-ab: + the A/B row)")
    args = ap.parse_args()
    prompts = [json.loads(line)["messages"] for line in open(args.prompts) if line.strip()]
    engine = Engine.load(args.target, draft=args.draft, backend="torch", dtype="float32",
                         draft_backend=args.draft_backend)
    engine.pin_cores = CorePins.first_two()
    if args.no_fallback:
        engine = engine.with_drafter(engine.drafter, fallback=None)
    rows = [(mode, variant) for mode in args.rows.split(",")
            for variant in (None, "before") if variant is None or (args.before_ab and mode != "sequential")]
    rows += [("overlap", "wait")] if args.fresh_ab else []
    labels = {None: "", "wait": ", every step waits for K", "before": ", lookahead as before"}
    print(f"draft {engine.drafter.name}; pinned; {len(prompts)} prompts, {args.max_new_tokens} new tokens, greedy")
    print("| round | mode | tok/s | tok/s without each request's first step | draft hidden | tokens/step |\n"
          "|---|---|---|---|---|---|")
    reference, equal = None, True
    for r in range(args.rounds):
        for mode, variant in rows:
            outputs = []
            with waiting_for_k(variant == "wait"), lookahead_as_before(variant == "before"):
                total, decode, hidden, per_step = run(engine, prompts, mode, args.max_new_tokens, outputs)
            reference = reference or outputs
            equal = equal and outputs == reference
            label = mode + labels[variant]
            print(f"| {r + 1} | {label} | {total:.2f} | {decode:.2f} | {hidden:.2f} | {per_step:.2f} |", flush=True)
    print("greedy outputs: " + ("token-equal in every row" if equal else "DIFFERENT between rows (FAILED)"))


if __name__ == "__main__":
    main()
