"""Retrieval drafter (REST-style): continue the context with what followed it in a datastore.

The datastore (mirrorsd.runtime.drafters.retrieval.datastore) holds token sequences from a corpus: the stdlib by default,
or the user's code, documents and past conversations. With `learn=True`, each finished request's
generated text is appended (SuffixDecoding-style), so repeated work speeds up over a session.
"""

from __future__ import annotations

from collections.abc import Sequence

from mirrorsd.config import GenerationConfig
from mirrorsd.contracts import Draft
from mirrorsd.runtime.drafters.retrieval.datastore import Datastore
from mirrorsd.runtime.drafters.continuation import draft_length_for_match


class RetrievalDrafter:
    name = "retrieval"
    model = None
    bounded = True  # lookups in memory-mapped arrays of a local datastore

    def __init__(self, datastore: Datastore, learn: bool = False, min_match: int = 2, max_match: int = 16,
                 min_share: float = 0.2) -> None:
        self.datastore = datastore
        self.learn = learn
        self.learner = self if learn else None
        self.min_match, self.max_match, self.min_share = min_match, max_match, min_share

    def start(self, config: GenerationConfig) -> None:
        pass

    def propose(self, committed: Sequence[int], k: int) -> Draft:
        if k <= 0:
            return Draft.empty(self.name)
        match = self.datastore.match(committed, k, self.min_match, self.max_match, min_share=self.min_share)
        if match is None or not match.tokens:
            return Draft.empty(self.name)
        return Draft(match.tokens[: draft_length_for_match(match.length, k)], None, self.name,
                     match=match.length)

    def accepted(self, committed: Sequence[int], n_accepted: int) -> None:
        pass

    def finish(self, prompt_ids: Sequence[int], generated: Sequence[int]) -> None:
        """End of a request: learn its generated tokens (when learn=True)."""
        if self.learn and len(generated):
            self.datastore.append(list(generated))
