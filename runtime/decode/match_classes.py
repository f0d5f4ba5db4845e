"""How far to verify a model-free draft: acceptance per match class, learned per verifier.

An n-gram or retrieval draft continues a suffix match (`Draft.match`), and how often the target accepts it
depends on that match far more than on the request: replayed greedy answers accept a 1-token n-gram match's
tokens about 0.3 of the time and a match of 2 or more 0.7-0.95, while retrieval's short matches in a generic
corpus stay near 0.2 (docs/measurements.md). Verifying a draft that will be rejected costs a pass over more
positions than a plain step, so each draft is verified only as far as its class pays, at that class's
acceptance and the verifier's measured cost curve. The estimates outlive a request (kept per verifier, like
the cost curve): the first drafts of each class pay for finding out, once per verifier, not per request.
Output never depends on any of this, only speed.
"""

from __future__ import annotations

import weakref
from dataclasses import replace

from mirrorsd.contracts import CausalLM, Draft
from mirrorsd.runtime.decode.estimates import AcceptanceEstimate
from mirrorsd.runtime.decode.speedup import VerifyCost, expected_tokens_per_step

LONGEST_CLASS = 4
"""Matches this long or longer form one class per source."""

FIRST_PROBE_AFTER = 8
"""A class whose drafts do not pay has one token verified again after this many of its drafts were skipped,
then after twice as many each time it still does not pay (up to LAST_PROBE_AFTER), so a class that started
unlucky can come back at a bounded cost."""
LAST_PROBE_AFTER = 128

Key = tuple[str, int]


class MatchClasses:
    """Per-token acceptance of model-free drafts by (source, match length)."""

    def __init__(self) -> None:
        self.acceptance: dict[Key, AcceptanceEstimate] = {}
        self.skipped: dict[Key, int] = {}  # drafts skipped since the class's last verified one
        self.probe_after: dict[Key, int] = {}

    def fit(self, draft: Draft, cost: VerifyCost) -> tuple[Draft, Key | None]:
        """The draft cut to the length k that maximises expected tokens per step over the pass's cost (the
        drafting is already done: only the pass is weighed), and its class (None when nothing is left to
        verify). k = 0 is a plain step, except for a probe."""
        key = (draft.source, min(draft.match, LONGEST_CLASS))
        alpha = self.acceptance.setdefault(key, AcceptanceEstimate()).alpha
        k = max(range(len(draft.tokens) + 1), key=lambda k: expected_tokens_per_step(alpha, k) / cost(k))
        if k > 0:
            self.probe_after.pop(key, None)
        else:
            skipped = self.skipped[key] = self.skipped.get(key, 0) + 1
            wait = self.probe_after.get(key, FIRST_PROBE_AFTER)
            if skipped >= wait:
                k, self.probe_after[key] = 1, min(2 * wait, LAST_PROBE_AFTER)
        if k > 0:
            self.skipped[key] = 0
        return (draft if k == len(draft.tokens) else replace(draft, tokens=draft.tokens[:k])), (key if k else None)

    def update(self, key: Key, n_drafted: int, n_accepted: int) -> None:
        self.acceptance[key].update(n_drafted, n_accepted)


_learned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shared(lm: CausalLM) -> MatchClasses:
    """The match classes learned on this verifier (a fresh set for one that cannot be weakly referenced)."""
    try:
        return _learned.setdefault(lm, MatchClasses())
    except TypeError:
        return MatchClasses()
