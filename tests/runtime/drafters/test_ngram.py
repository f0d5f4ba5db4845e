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


def test_a_draft_names_the_length_of_the_match_it_continues():
    d = NGramDrafter(max_ngram=4, min_ngram=1)
    assert d.propose([7, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 7], 16).match == 1
    assert d.propose([9, 9, 7, 8, 1, 2, 9, 9, 7, 8], 4).match == 4
    assert d.propose([1, 2, 3], 4).match == 0


def _reference(history, max_tokens, max_ngram, min_ngram, min_share=0.2, max_occurrences=64):
    """The n-gram rule written plainly: the longest suffix with earlier occurrences, then the most frequent
    continuation token by token (ties: the most recent), stopping below min_share of the occurrences left."""
    from mirrorsd.runtime.drafters.continuation import draft_length_for_match
    for n in range(min(max_ngram, len(history) - 1), min_ngram - 1, -1):
        ends = [i + n for i in range(len(history) - n) if history[i:i + n] == history[-n:]][-max_occurrences:]
        if not ends:
            continue
        rows, path = [history[e:] for e in ends], []  # oldest first
        for d in range(draft_length_for_match(n, max_tokens)):
            column = [r[d] if d < len(r) else None for r in rows]  # None: the history ended there
            counts = {}
            for i, token in enumerate(column):
                counts[token] = (counts.get(token, (0, -1))[0] + 1, i)  # (count, the latest row holding it)
            token, (count, _) = max(counts.items(), key=lambda kv: kv[1])
            if token is None or count < max(min_share * len(rows), 1):
                break
            path.append(token)
            rows = [r for r, t in zip(rows, column) if t == token]
        if path:
            return path, n
    return [], 0


def test_proposals_match_a_plain_reference_on_random_histories():
    import random
    rng = random.Random(7)
    for _ in range(400):
        vocab = rng.choice([2, 3, 5, 40])
        history = [rng.randrange(vocab) for _ in range(rng.randint(1, 120))]
        if len(history) > 10 and rng.random() < 0.5:
            i = rng.randrange(len(history) - 5)
            history += history[i:i + rng.randint(1, 12)]
        max_ngram = rng.randint(1, 5)
        min_ngram = rng.randint(1, max_ngram)
        k = rng.randint(1, 12)
        draft = NGramDrafter(max_ngram=max_ngram, min_ngram=min_ngram).propose(history, k)
        assert (draft.tokens, draft.match) == _reference(history, k, max_ngram, min_ngram), (history, k)
