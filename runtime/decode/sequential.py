"""The sequential draft-verify loop: the whole of speculative decoding in one generator.

Each step: the drafter proposes up to K tokens (unless the gate has measured that drafting does not
pay right now), the verifier scores the last committed token plus the draft in one forward pass,
`verify` keeps the accepted prefix plus one target token, and the tokens are committed. Rollback is
implicit: the verifier's next `score` truncates its KV cache to the committed history, and drafters
reconcile against it the same way. The step's bookkeeping is the step core's (step.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from mirrorsd.config import GenerationConfig
from mirrorsd.contracts import CausalLM, Drafter, Step
from mirrorsd.runtime.decode.step import DraftSource, StepCore, make_step
from mirrorsd.runtime.timeline import Timeline
from mirrorsd.structured import GrammarConstraint


def speculative_decode(
    verifier: CausalLM,
    drafter: Drafter | None,
    prompt_ids: Sequence[int],
    config: GenerationConfig,
    max_new_tokens: int,
    timeline: Timeline | None = None,
    fallback: Drafter | None = None,
    constraint: GrammarConstraint | None = None,
    draft_core: int | None = None,
) -> Iterator[Step]:
    """Yield Steps until max_new_tokens are committed (the caller stops early on EOS/stop strings).
    A drafter that fails is dropped for the request; `fallback` (if any) drafts from then on.
    constraint: the request's grammar (structured output): drafts stop at a forbidden token and the target's
    distribution is the grammar-masked one. draft_core: the CPU core the drafter runs on (CorePins)."""
    core = StepCore(verifier, prompt_ids, config, max_new_tokens, timeline, constraint=constraint)
    source = DraftSource(drafter, fallback, config, verifier.vocab_size, core.timeline, draft_core)
    try:
        while not core.done:
            start = time.perf_counter()
            budget = core.budget() if source.active else 0
            draft = core.constrain(source.propose(core.committed, budget), budget)
            outcome = core.verify(draft)
            core.commit(outcome)
            source.accepted(core.committed, outcome.n_accepted)
            draft_seconds = outcome.start - start
            core.learn(len(draft.tokens), draft_seconds, outcome, draft_seconds + outcome.seconds)
            yield make_step(draft, outcome, draft_seconds, source.take_fault())
    finally:
        source.close()
