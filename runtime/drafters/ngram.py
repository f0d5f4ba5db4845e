"""Prompt-lookup / n-gram drafter: propose what followed earlier occurrences of the current suffix.

Model-free, so it costs microseconds and needs no device. It tries the longest suffix first
(max_ngram down to min_ngram) over prompt + generated text; among all earlier occurrences of that
suffix it follows the most frequent continuation (ties: the most recent), stopping where the
occurrences disagree too much (min_share) and at a length that grows with the match length. No match
is an empty draft, which the loop turns into a plain decode step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mirrorsd.config import GenerationConfig
from mirrorsd.contracts import Draft
from mirrorsd.runtime.drafters.continuation import continuation_matrix, draft_length_for_match, likeliest_path


class NGramDrafter:
    name = "ngram"
    model = None
    learner = None
    bounded = True

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, min_share: float = 0.2,
                 max_occurrences: int = 64) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.min_share = min_share
        self.max_occurrences = max_occurrences

    def start(self, config: GenerationConfig) -> None:
        pass  # stateless: the committed history is all it needs

    def propose(self, committed: Sequence[int], k: int) -> Draft:
        if k <= 0 or len(committed) < 2:
            return Draft.empty(self.name)
        seq = np.asarray(committed, dtype=np.int64)  # [L]
        for n, ends in self._matches(seq):
            hits = ends[-self.max_occurrences:]
            if hits.size:
                cont = continuation_matrix(seq, hits + 1, draft_length_for_match(n, k))
                tokens, _ = likeliest_path(cont, self.min_share)
                if tokens:
                    return Draft(tokens, None, self.name, match=n)
        return Draft.empty(self.name)

    def _matches(self, seq: np.ndarray):
        """(n, end positions of earlier occurrences of the last n tokens), longest n first: the positions
        matching the last token, narrowed one token further back per n (one pass over the history)."""
        ends = [np.flatnonzero(seq[:-1] == seq[-1])]  # [hits]; never the suffix itself
        for n in range(2, min(self.max_ngram, len(seq) - 1) + 1):
            prev = ends[-1][ends[-1] >= n - 1]
            ends.append(prev[seq[prev - (n - 1)] == seq[-n]])
            if not ends[-1].size:
                break
        for n in range(len(ends), self.min_ngram - 1, -1):
            yield n, ends[n - 1]

    def accepted(self, committed: Sequence[int], n_accepted: int) -> None:
        pass
