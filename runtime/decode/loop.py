"""The draft-verify loop: the whole of speculative decoding in one generator, for every mode.

Each step: a draft provider hands over up to K drafted tokens (none while the gate has measured that
drafting does not pay), the target scores the last committed token plus the draft in one forward pass,
`verify` keeps the accepted prefix plus one target token, the tokens are committed, and the provider
learns where the step landed. Rollback is implicit: the target's next `score` truncates its KV cache to
the committed history, and drafters reconcile against it the same way. The verify step itself -- the target's
pass, the accept rule, the commit -- is verify.py's (`DecodeState`, `verify`).

Providers differ only in where a draft comes from and when:
- `InlineProvider`: the drafter runs between verify passes, on this thread's schedule ("off").
- `PipelinedProvider` (pipeline/provider.py): a draft worker drafts ahead while the target verifies ("overlap",
  "branches").
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Protocol

from mirrorsd.contracts import Draft, Drafter, ExitRequest, HintOutcome, Step
from mirrorsd.runtime.decode.drafting import CheckedDrafter
from mirrorsd.runtime.decode.pipeline.provider import PipelinedProvider
from mirrorsd.runtime.decode.plan import DecodePlan
from mirrorsd.runtime.decode.verify import DecodeState, Outcome, make_step


class DraftProvider(Protocol):
    """Where a step's draft comes from."""

    def draft(self) -> tuple[Draft, ExitRequest | None]:
        """This step's draft, within the step's draft length K and grammar, and the early-exit request to
        publish branch candidates through (None: none)."""

    def learn(self, draft: Draft, outcome: Outcome, waited: float) -> tuple[str | None, HintOutcome | None]:
        """After commit: update the estimators and the drafter with where the step landed (`waited`: the
        seconds from the step's start to its verify pass). Returns the step's branch result and hint record."""

    def take_fallback(self) -> str | None:
        """The reason a drafter was dropped during this step, once."""

    def close(self) -> None:
        """Stop whatever the provider started (threads, the drafter's request)."""


class InlineProvider:
    """Drafts between verify passes on the calling thread's schedule (the drafter itself runs on a drafting
    thread, so that a hung one can be abandoned: CheckedDrafter). A drafter that fails is dropped for the
    request; `helper` (if any) drafts from then on."""

    def __init__(self, state: DecodeState, drafter: Drafter | None, helper: Drafter | None = None,
                 draft_core: int | None = None) -> None:
        self.state = state
        self.drafting = CheckedDrafter(drafter, helper, state.config, state.target.vocab_size, state.timeline,
                                       draft_core)

    def draft(self) -> tuple[Draft, ExitRequest | None]:
        k = self.state.step_k() if self.drafting.active else 0
        return self.state.fit(self.drafting.propose(self.state.committed, k), k), None

    def learn(self, draft: Draft, outcome: Outcome, waited: float) -> tuple[str | None, HintOutcome | None]:
        self.drafting.accepted(self.state.committed, outcome.accepted_tokens)
        self.state.learn(len(draft.tokens), waited, outcome, waited + outcome.verify_time_s)
        return None, None

    def take_fallback(self) -> str | None:
        return self.drafting.take_fallback()

    def close(self) -> None:
        self.drafting.close()


def run_plan(state: DecodeState, drafter: Drafter | None, helper: Drafter | None, plan: DecodePlan) -> Iterator[Step]:
    """Yield the request's Steps until its max_new_tokens are committed (the caller stops early on EOS / stop
    strings), drafting through the provider the plan names. A generator: no thread starts before the caller
    asks for the first step."""
    if plan.mode == "off":
        provider: DraftProvider = InlineProvider(state, drafter, helper, plan.draft_core)
    else:
        provider = PipelinedProvider(state, drafter, helper, plan)
    try:
        while not state.done:
            start = time.perf_counter()
            draft, exit_request = provider.draft()
            outcome = state.verify(draft, exit_request)
            state.commit(outcome)
            waited = outcome.start - start
            branch, hint = provider.learn(draft, outcome, waited)
            yield make_step(draft, outcome, waited, provider.take_fallback(), branch, hint)
    finally:
        provider.close()
