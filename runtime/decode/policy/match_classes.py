"""How far to verify a model-free draft: acceptance per match class, learned per target.

An n-gram or retrieval draft continues a suffix match (`Draft.match`), and how often the target accepts it
depends on that match far more than on the request: replayed greedy answers accept a 1-token n-gram match's
tokens about a third of the time and a match of 2 or more 0.7-0.95, while retrieval's short matches in a generic
corpus stay near 0.2 (docs/measurements.md). Verifying a draft that will be rejected costs a pass over more
positions than a plain step, so each draft is verified only as far as its class pays, at that class's
acceptance and the target's measured cost curve.

A draft that is not verified still teaches its class: the plain step that replaces it commits the target's own
next token, which equals the draft's first token exactly as often as verification would have accepted it (under
greedy decoding when it is the argmax; under sampling with probability p(token), a one-hot draft's acceptance
probability). So a class that stops paying keeps being measured at no cost, and comes back when it pays again.
The estimates outlive a request (kept per target, like the cost curve). Output never depends on any of this,
only speed.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import replace

from mirrorsd.contracts import CausalLM, Draft
from mirrorsd.runtime.decode.policy.estimates import AcceptanceEstimate
from mirrorsd.runtime.decode.policy.speedup import expected_tokens_per_step

LONGEST_CLASS = 4
"""Matches this long or longer form one class per source."""

Key = tuple[str, int]


class MatchClasses:
    """Per-token acceptance of model-free drafts by (source, match length)."""

    def __init__(self) -> None:
        self.acceptance: dict[Key, AcceptanceEstimate] = {}

    @staticmethod
    def key(draft: Draft) -> Key:
        return draft.source, min(draft.match, LONGEST_CLASS)

    def fit(self, draft: Draft, cost: Sequence[float]) -> Draft:
        """The draft cut to the length k that maximises expected tokens per step over the pass's cost (cost[k]:
        the pass over k drafted tokens in plain steps; the drafting is already done, so only the pass is
        weighed); k = 0 is a plain step."""
        alpha = self.acceptance.setdefault(self.key(draft), AcceptanceEstimate()).alpha
        k = max(range(len(draft.tokens) + 1), key=lambda k: expected_tokens_per_step(alpha, k) / cost[k])
        return draft if k == len(draft.tokens) else replace(draft, tokens=draft.tokens[:k])

    def learn(self, proposed: Draft, verified: int, n_accepted: int, committed: list[int]) -> None:
        """After the step: `verified` of the proposed draft's tokens went to the pass, n_accepted of them were
        accepted, and the step committed `committed`. An unverified draft counts its first token against the
        target's own."""
        if verified == 0:
            verified, n_accepted = 1, int(committed[0] == proposed.tokens[0])
        self.acceptance.setdefault(self.key(proposed), AcceptanceEstimate()).update(verified, n_accepted)


_learned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shared(lm: CausalLM) -> MatchClasses:
    """The match classes learned on this target (a fresh set for one that cannot be weakly referenced)."""
    try:
        return _learned.setdefault(lm, MatchClasses())
    except TypeError:
        return MatchClasses()
