"""The draft-verify loop: the whole of speculative decoding in one generator.

Each step: the drafter proposes up to K tokens (unless the gate has measured that drafting does not
pay right now), the verifier scores the last committed token plus
the draft in one forward pass, `verify` keeps the accepted prefix plus one target token, and the
tokens are committed. Rollback is implicit: the verifier's next `score` truncates its KV cache to
the committed history, and drafters reconcile against it the same way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from mirrorsd.config import GenerationConfig
from mirrorsd.contracts import Draft, Drafter, Verifier
from mirrorsd.runtime.decode.schedule import SpeculationGate, make_schedule
from mirrorsd.runtime.timeline import DRAFT, VERIFY, Timeline
from mirrorsd.verify import verify

log = logging.getLogger("mirrorsd")


@dataclass(frozen=True)
class Step:
    """One verify step's outcome."""

    tokens: list[int]  # committed this step: accepted draft tokens + correction/bonus
    n_drafted: int
    n_accepted: int
    source: str  # drafter that served this step ("none" for a plain decode step)
    draft_time: float  # seconds spent in propose()
    verify_time: float  # seconds spent in score() + verify()
    fallback: str | None = None  # why a drafter was dropped during this step, if it was
    branch: str | None = None  # pipeline only: "hit"/"miss" when the step left the lookahead after
    # early-exit branches were prepared, None otherwise


def speculative_decode(
    verifier: Verifier,
    drafter: Drafter | None,
    prompt_ids: Sequence[int],
    config: GenerationConfig,
    max_new_tokens: int,
    timeline: Timeline | None = None,
    fallback: Drafter | None = None,
) -> Iterator[Step]:
    """Yield Steps until max_new_tokens are committed (the caller stops early on EOS/stop strings).
    A drafter that fails is dropped for the request; `fallback` (if any) drafts from then on."""
    timeline = timeline or Timeline()
    rng = np.random.default_rng(config.seed)
    committed = list(prompt_ids)
    schedule = make_schedule(config)
    gate = SpeculationGate(enabled=config.greedy or config.seed is None)
    if drafter is not None:
        drafter.start(config)
    generated = 0
    while generated < max_new_tokens:
        # The step commits at most k + 1 tokens; never draft past the budget or the context.
        budget = min(schedule.k, max_new_tokens - generated - 1, verifier.max_context - len(committed) - 1)
        reason = None
        t0 = time.perf_counter()
        draft = Draft.empty()
        if drafter is not None and budget > 0 and gate.should_draft():
            try:
                draft = drafter.propose(committed, budget)
                _check_draft(draft, budget, verifier.vocab_size)
            except Exception as exc:  # a failing drafter costs speed, never output
                reason, drafter, fallback, draft = _drop(drafter, exc), _start(fallback, config), None, Draft.empty()
        t1 = time.perf_counter()
        logits = verifier.score(committed, draft.tokens)  # [k+1, V]
        n_accepted, new_tokens = verify(draft, logits, config, rng, history=committed)
        t2 = time.perf_counter()
        if draft.tokens:
            timeline.add(DRAFT, t0, t1, "draft", tokens=len(draft.tokens))
        timeline.add(VERIFY, t1, t2, "verify", k=len(draft.tokens), accepted=n_accepted)
        committed.extend(new_tokens)
        generated += len(new_tokens)
        if drafter is not None:
            try:
                drafter.accepted(committed, n_accepted)
            except Exception as exc:
                reason, drafter, fallback = _drop(drafter, exc), _start(fallback, config), None
        if generated > len(new_tokens):  # the first step carries the prompt prefill: not a fair sample
            schedule.observe(len(draft.tokens), t1 - t0, t2 - t1)
            gate.record(bool(draft.tokens), len(new_tokens), t2 - t0)
        schedule.update(len(draft.tokens), n_accepted)
        yield Step(new_tokens, len(draft.tokens), n_accepted, draft.source if draft.tokens else "none",
                   t1 - t0, t2 - t1, reason)


def _start(drafter: Drafter | None, config: GenerationConfig) -> Drafter | None:
    if drafter is not None:
        drafter.start(config)
    return drafter


def _drop(drafter: Drafter, exc: Exception) -> str:
    reason = f"drafter {getattr(drafter, 'name', drafter)!r} dropped: {exc}"
    log.warning("%s; continuing without drafting", reason)
    return reason


def _check_draft(draft: Draft, budget: int, vocab_size: int) -> None:
    """A draft must be short enough, in-vocabulary and carry one q row per token."""
    k = len(draft.tokens)
    if k > budget:
        raise ValueError(f"proposed {k} tokens, more than the {budget} asked for")
    if any(not (0 <= int(t) < vocab_size) for t in draft.tokens):
        raise ValueError(f"proposed token ids outside the target vocabulary [0, {vocab_size})")
    if draft.probs is not None and draft.probs.shape[0] != k:
        raise ValueError(f"draft probs have {draft.probs.shape[0]} rows for {k} tokens")
