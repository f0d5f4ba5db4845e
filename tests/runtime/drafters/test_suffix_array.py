"""The suffix-array index against brute force on random data."""

from __future__ import annotations

import numpy as np
import pytest

from mirrorsd.runtime.drafters.continuation import SEPARATOR, likeliest_path
from mirrorsd.runtime.drafters.retrieval.suffix_array import build_suffix_array, find_range


@pytest.mark.parametrize("n,vocab", [(0, 2), (1, 3), (2, 2), (57, 2), (400, 3), (1500, 40)])
def test_suffix_array_equals_sorting_all_suffixes(n, vocab):
    tokens = np.random.default_rng(n).integers(-1, vocab, n)  # -1: document separators mixed in
    sa = build_suffix_array(tokens)
    assert sa.tolist() == sorted(range(n), key=lambda i: tokens[i:].tolist())


def test_find_range_finds_exactly_the_occurrences():
    r = np.random.default_rng(1)
    tokens = r.integers(0, 4, 3000)
    sa = build_suffix_array(tokens)
    for _ in range(300):
        pattern = r.integers(0, 4, int(r.integers(1, 7))).tolist()
        lo, hi = find_range(tokens, sa, pattern)
        m = len(pattern)
        brute = [i for i in range(len(tokens) - m + 1) if tokens[i : i + m].tolist() == pattern]
        assert sorted(sa[lo:hi].tolist()) == brute


def test_likeliest_path_prefers_frequency_then_recency_and_stops_at_separators():
    cont = np.array([[5, 6, 7], [5, 6, 8], [9, 1, 1], [5, 6, 8]])
    assert likeliest_path(cont) == ([5, 6, 8], 2)
    tie = np.array([[1, 2], [3, 4]])
    assert likeliest_path(tie) == ([3, 4], 1)  # the later row is the more recent occurrence
    assert likeliest_path(np.array([[4, SEPARATOR, 7]])) == ([4], 1)
    split = np.array([[1, 2], [1, 3], [1, 4], [1, 5]])
    assert likeliest_path(split, min_share=0.5) == ([1], 4)  # the occurrences disagree after 1
