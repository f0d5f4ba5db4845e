from mirrorsd import GenerationConfig
from mirrorsd.runtime.schedule import DraftLengthSchedule


def test_adaptive_k_grows_on_full_acceptance_and_shrinks_otherwise():
    s = DraftLengthSchedule(GenerationConfig(num_draft_tokens=4, max_draft_tokens=9))
    assert s.update(4, 4) == 6
    assert s.update(6, 6) == 8
    assert s.update(8, 8) == 9  # capped
    assert s.update(9, 2) == 8
    for _ in range(20):
        s.update(s.k, 0)
    assert s.k == 1  # never below one
    assert s.update(0, 0) == 1  # an empty draft (no n-gram match) says nothing about acceptance


def test_fixed_k_when_adaptive_is_off():
    s = DraftLengthSchedule(GenerationConfig(num_draft_tokens=5, adaptive_k=False))
    assert [s.update(5, n) for n in (5, 0, 3)] == [5, 5, 5]
