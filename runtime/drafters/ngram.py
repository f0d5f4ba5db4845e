"""Prompt-lookup / n-gram drafter: propose what followed the last time the current suffix occurred.

Model-free, so it costs microseconds and needs no device. It tries the longest suffix first
(max_ngram down to min_ngram) over prompt + generated text and copies the continuation of the most
recent earlier occurrence. No match is an empty draft, which the loop turns into a plain decode step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from mirrorsd.config import GenerationConfig
from mirrorsd.contracts import Draft


class NGramDrafter:
    name = "ngram"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def start(self, config: GenerationConfig) -> None:
        pass  # stateless: the committed history is all it needs

    def propose(self, committed: Sequence[int], max_tokens: int) -> Draft:
        if max_tokens <= 0 or len(committed) < 2:
            return Draft.empty(self.name)
        seq = np.asarray(committed, dtype=np.int64)  # [L]
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            suffix = seq[-n:]  # [n]
            windows = sliding_window_view(seq[:-1], n)  # [L-n, n]; window j starts at j, never the suffix itself
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # most recent occurrence: continuation starts after it
                cont = seq[start : start + max_tokens].tolist()
                if cont:
                    return Draft(cont, None, self.name)
        return Draft.empty(self.name)

    def accepted(self, committed: Sequence[int], n_accepted: int) -> None:
        pass
