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
from numpy.lib.stride_tricks import sliding_window_view

from mirrorsd.config import GenerationConfig
from mirrorsd.contracts import Draft
from mirrorsd.runtime.drafters.continuation import continuation_matrix, draft_length_for_match, likeliest_path


class NGramDrafter:
    name = "ngram"
    model = None
    learner = None

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, min_share: float = 0.2,
                 max_occurrences: int = 64) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.min_share = min_share
        self.max_occurrences = max_occurrences
        self.last_match = (0, 0)  # (match length, support) of the last proposal

    def start(self, config: GenerationConfig) -> None:
        pass  # stateless: the committed history is all it needs

    def propose(self, committed: Sequence[int], max_tokens: int) -> Draft:
        self.last_match = (0, 0)
        if max_tokens <= 0 or len(committed) < 2:
            return Draft.empty(self.name)
        seq = np.asarray(committed, dtype=np.int64)  # [L]
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            windows = sliding_window_view(seq[:-1], n)  # [L-n, n]; never the suffix itself
            hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))[-self.max_occurrences:]
            if hits.size:
                cont = continuation_matrix(seq, hits + n, draft_length_for_match(n, max_tokens))
                tokens, support = likeliest_path(cont, self.min_share)
                if tokens:
                    self.last_match = (n, support)
                    return Draft(tokens, None, self.name)
        return Draft.empty(self.name)

    def accepted(self, committed: Sequence[int], n_accepted: int) -> None:
        pass
