"""Suffix arrays over token ids: a datastore segment's index (the retrieval drafter memory-maps one per
segment). Why a suffix array and not a suffix automaton: it is two flat
int32 arrays (tokens, suffix order) that numpy builds with prefix doubling and that memory-map as they
are, so a datastore opens in milliseconds without loading; an automaton is a pointer graph that would
have to be serialized and loaded. Lookups are binary searches: O(m log N) token comparisons.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np



def build_suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Suffix array of tokens [N] by prefix doubling (Manber-Myers with numpy sorts); int32 or int64 [N].

    Peak memory is about 60 bytes per token (a few int64 work arrays); time O(N log N) per doubling
    round, and rounds = log2 of the longest repeated substring.
    """
    n = len(tokens)
    index_dtype = np.int32 if n < 2**31 - 1 else np.int64
    if n == 0:
        return np.zeros(0, dtype=index_dtype)
    _, rank = np.unique(np.asarray(tokens, dtype=np.int64), return_inverse=True)
    rank = rank.astype(np.int64)
    k = 1
    while True:
        second = np.full(n, -1, dtype=np.int64)
        second[: n - k] = rank[k:] if k < n else second[:0]
        order = np.lexsort((second, rank))  # by rank, then by the rank k tokens later
        r1, r2 = rank[order], second[order]
        new_group = np.empty(n, dtype=bool)
        new_group[0] = True
        new_group[1:] = (r1[1:] != r1[:-1]) | (r2[1:] != r2[:-1])
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.cumsum(new_group) - 1
        if rank[order[-1]] == n - 1 or k >= n:  # all ranks distinct: order is the suffix array
            return order.astype(index_dtype)
        k *= 2


def find_range(tokens: np.ndarray, sa: np.ndarray, pattern: Sequence[int]) -> tuple[int, int]:
    """[lo, hi) of the suffixes in sa that start with pattern (binary search; tokens may be a memmap)."""
    m = len(pattern)
    pattern = list(pattern)

    def prefix(i: int) -> list[int]:
        s = int(sa[i])
        return tokens[s : s + m].tolist()

    lo, hi = 0, len(sa)
    while lo < hi:  # first suffix whose m-prefix >= pattern
        mid = (lo + hi) // 2
        if prefix(mid) < pattern:
            lo = mid + 1
        else:
            hi = mid
    start, hi = lo, len(sa)
    while lo < hi:  # first suffix whose m-prefix > pattern
        mid = (lo + hi) // 2
        if prefix(mid) <= pattern:
            lo = mid + 1
        else:
            hi = mid
    return start, lo
