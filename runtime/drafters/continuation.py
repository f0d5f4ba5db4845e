"""Following earlier occurrences of a match: what the n-gram and retrieval drafters share.

Both find places where the current suffix occurred before (in the request, or in a datastore), read
what followed each (a continuation matrix), walk the likeliest path through those continuations, and
draft further the longer the match.
"""

from __future__ import annotations

import numpy as np

SEPARATOR = -1  # between documents: never matched, ends every continuation


def draft_length_for_match(match_length: int, k: int) -> int:
    """Longer matches predict further: a 1-token match drafts up to 4 tokens, 2 -> 6, 3+ -> all of K
    (chosen by replaying real greedy answers through the drafters: docs/measurements.md)."""
    return k if match_length >= 3 else min(k, 2 * match_length + 2)


def continuation_matrix(tokens: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    """[len(starts), length] tokens following each start; SEPARATOR past a document or array end."""
    idx = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(length)  # [n, length]
    inside = idx < len(tokens)
    out = np.full(idx.shape, SEPARATOR, dtype=np.int64)
    out[inside] = tokens[idx[inside]]
    ended = np.cumsum(out == SEPARATOR, axis=1) > 0  # nothing after a separator counts
    out[ended] = SEPARATOR
    return out


def likeliest_path(cont: np.ndarray, min_share: float = 0.0, min_support: int = 1) -> tuple[list[int], int]:
    """Greedy most-frequent path through continuations [n, L] (rows in order of recency: later rows
    win ties). Stops at a separator, when the chosen token's share of the surviving rows falls below
    min_share, or when fewer than min_support rows agree. Returns (tokens, support = rows that agree
    with the whole path)."""
    alive = np.arange(cont.shape[0])
    path: list[int] = []
    for d in range(cont.shape[1]):
        if len(alive) == 1 and min_support <= 1:  # one occurrence left: the rest of it, up to a separator
            rest = cont[alive[0], d:]
            ends = np.flatnonzero(rest == SEPARATOR)
            path += rest[: ends[0] if ends.size else len(rest)].tolist()
            break
        col = cont[alive, d]
        values, inverse, counts = np.unique(col, return_inverse=True, return_counts=True)
        last_row = np.zeros(len(values), dtype=np.int64)
        np.maximum.at(last_row, inverse, alive)
        best = int(np.lexsort((last_row, counts))[-1])  # most frequent, then most recent
        token = int(values[best])
        if token == SEPARATOR or counts[best] < max(min_share * len(alive), min_support):
            break
        path.append(token)
        alive = alive[col == token]
    return path, len(alive)
