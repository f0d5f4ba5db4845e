from mirrorsd.runtime.drafters import NGramDrafter


def test_longest_suffix_match_wins_and_proposes_the_continuation():
    d = NGramDrafter(max_ngram=3, min_ngram=1)
    # suffix [7, 8, 9] occurred before, followed by 1 2 3; the 1-gram [9] also occurs followed by 5
    history = [9, 5, 7, 8, 9, 1, 2, 3, 4, 7, 8, 9]
    assert d.propose(history, 3).tokens == [1, 2, 3]


def test_most_recent_occurrence_is_used():
    d = NGramDrafter(max_ngram=2, min_ngram=1)
    assert d.propose([1, 2, 5, 1, 2, 6, 1, 2], 1).tokens == [6]


def test_no_match_is_an_empty_draft():
    d = NGramDrafter(max_ngram=3, min_ngram=2)
    assert d.propose([1, 2, 3, 4, 5], 4).tokens == []
    assert d.propose([1], 4).tokens == []
    assert d.propose([1, 2, 1, 2], 0).tokens == []


def test_proposal_is_capped_by_max_tokens_and_history():
    d = NGramDrafter()
    assert d.propose([4, 4, 4, 4, 4], 10).tokens == [4]  # the continuation runs into the end of history
    assert len(d.propose(list(range(20)) + [3], 2).tokens) == 2


def test_frequency_beats_recency_among_matches():
    d = NGramDrafter(max_ngram=2, min_ngram=2)
    assert d.propose([1, 2, 5, 1, 2, 5, 1, 2, 6, 1, 2], 1).tokens == [5]


def test_draft_length_grows_with_match_length():
    d = NGramDrafter(max_ngram=4, min_ngram=1)
    one = d.propose([7, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 7], 16)  # 1-token match
    assert one.tokens == [1, 2, 3, 4]
    two = d.propose([7, 7, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 7, 7], 16)  # 2-token match
    assert two.tokens == [1, 2, 3, 4, 5, 6]
    four = d.propose([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4], 16)  # 4-token match
    assert four.tokens == [5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4]  # all the history has, up to K
