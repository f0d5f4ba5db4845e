"""The model-free chain: ask the n-gram and retrieval drafters each step, keep the likelier draft.

"Likelier" is learned, not assumed: for each drafter and suffix-match length the chain keeps a
moving average of how many of its draft tokens the target accepted when it served, and picks the
non-empty draft with the highest expected accepted length (optimistic start, so each gets tried;
ties go to the longer match, then to the earlier drafter: the request's own context before a corpus).
The chosen drafter's name is the draft's source, so stats say which one served each step. (Which draft a
step verifies changes no token, seeded sampling included: one-hot drafts are verified with target-only's own
draws, runtime/decode/verify.py.)
"""

from __future__ import annotations

from collections.abc import Sequence

from mirrorsd.config import GenerationConfig
from mirrorsd.contracts import Draft, Drafter

OPTIMISTIC = 4.0  # expected accepted tokens before a (drafter, match length) has any history
DECAY = 0.8


class ChainDrafter:
    """Model-free drafters whose drafts say the match they continued (`Draft.match`)."""

    model = None

    def __init__(self, *drafters: Drafter) -> None:
        self.drafters = drafters
        self.name = "chain(" + ",".join(d.name for d in drafters) + ")"
        self._learners = [d.learner for d in drafters if d.learner is not None]
        self.learner = self if self._learners else None
        self.bounded = all(d.bounded for d in drafters)
        self.expected: dict[tuple[int, int], float] = {}  # (drafter index, match length bucket) -> accepted
        self._served: tuple[int, int] | None = None

    def start(self, config: GenerationConfig) -> None:
        for d in self.drafters:
            d.start(config)

    def propose(self, committed: Sequence[int], k: int) -> Draft:
        best, best_key, self._served = Draft.empty(self.name), None, None
        for i, d in enumerate(self.drafters):
            draft = d.propose(committed, k)
            if not draft.tokens:
                continue
            bucket = (i, min(draft.match, 8))
            expected = self.expected.get(bucket, OPTIMISTIC)
            key = (min(expected, len(draft.tokens)), draft.match, -i)
            if best_key is None or key > best_key:
                best, best_key, self._served = draft, key, bucket
        return best

    def accepted(self, committed: Sequence[int], n_accepted: int) -> None:
        if self._served is not None:  # learn only from steps this chain's draft served
            old = self.expected.get(self._served, OPTIMISTIC)
            self.expected[self._served] = DECAY * old + (1 - DECAY) * n_accepted
        self._served = None
        for d in self.drafters:
            d.accepted(committed, n_accepted)

    def finish(self, prompt_ids: Sequence[int], generated: Sequence[int]) -> None:
        for learner in self._learners:
            learner.finish(prompt_ids, generated)
