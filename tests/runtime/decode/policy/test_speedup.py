"""Leviathan's speedup formula (mirrorsd.runtime.decode.policy.speedup) against values computed by hand."""

from __future__ import annotations

import pytest

from mirrorsd.runtime.decode.policy.speedup import best_k, expected_tokens_per_step, speedup


def test_expected_tokens_per_step_by_hand():
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert expected_tokens_per_step(0.8, 4) == pytest.approx(3.3616)  # (1 - 0.8^5) / 0.2
    assert expected_tokens_per_step(0.0, 5) == 1.0  # only the correction token
    assert expected_tokens_per_step(1.0, 3) == 4.0  # every draft accepted + the bonus token
    assert expected_tokens_per_step(0.7, 0) == 1.0  # no draft: a plain decode step


def test_speedup_sequential_by_hand():
    assert speedup(0.5, 2, 0.0) == pytest.approx(1.75)  # free drafts: speedup = tokens per step
    assert speedup(0.5, 2, 0.25) == pytest.approx(1.75 / 1.5)  # step costs 2 * 0.25 + 1
    assert speedup(0.8, 4, 0.05) == pytest.approx(3.3616 / 1.2)
    assert speedup(0.0, 4, 0.1) == pytest.approx(1 / 1.4)  # drafts that always fail only cost
    assert speedup(0.5, 2, 1.0) == pytest.approx(1.75 / 3)


def test_speedup_overlapped_by_hand():
    # alpha 0.5, K 2: the step lands on the lookahead with probability 0.5^3 = 0.125.
    # c 0.25: 0.125 * max(0.5, 1) + 0.875 * 1.5 = 1.4375
    assert speedup(0.5, 2, 0.25, overlapped=True) == pytest.approx(1.75 / 1.4375)
    # c 1: drafting (2) outlasts verify (1): 0.125 * 2 + 0.875 * 3 = 2.875
    assert speedup(0.5, 2, 1.0, overlapped=True) == pytest.approx(1.75 / 2.875)
    # alpha 0.8, K 4, c 0.05: 0.32768 * 1 + 0.67232 * 1.2 = 1.134464
    assert speedup(0.8, 4, 0.05, overlapped=True) == pytest.approx(3.3616 / 1.134464)
    assert speedup(1.0, 4, 0.05, overlapped=True) == pytest.approx(5.0)  # always on the lookahead: free drafts
    # a verify pass growing by 0.05 per draft token, sequential: 1 + 0.2 + 0.4
    assert speedup(0.8, 4, 0.1, growth=0.05) == pytest.approx(3.3616 / 1.6)
    for alpha in (0.1, 0.5, 0.9):  # overlap never costs more than sequential
        for k in (1, 4, 8):
            for c in (0.01, 0.2, 1.0):
                assert speedup(alpha, k, c, overlapped=True) >= speedup(alpha, k, c) - 1e-12


def test_short_fresh_steps_by_hand():
    """alpha 0.5, K 2, c 0.25, a step after a miss verifies 1 token: steady steps stay steady with 0.125,
    fresh ones turn steady with 0.25, so 0.875 / 1.125 of the steps are fresh; they carry 1.5 tokens for
    1.25 units, steady ones 1.75 for max(1, 0.5)."""
    fresh = 0.875 / 1.125
    tokens, cost = (1 - fresh) * 1.75 + fresh * 1.5, (1 - fresh) * 1.0 + fresh * 1.25
    assert speedup(0.5, 2, 0.25, overlapped=True, fresh_k=1) == pytest.approx(tokens / cost)
    for alpha, k, c in ((0.5, 2, 0.25), (0.9, 6, 0.1), (0.3, 3, 1.0)):  # fresh_k = K is the plain formula
        assert speedup(alpha, k, c, overlapped=True, fresh_k=k) == speedup(alpha, k, c, overlapped=True)
    # A costly draft that rarely misses: the target waiting for 1 fresh token instead of 4 pays.
    assert speedup(0.9, 4, 0.25, overlapped=True, fresh_k=1) > speedup(0.9, 4, 0.25, overlapped=True)
    assert speedup(1.0, 4, 0.25, overlapped=True, fresh_k=1) == pytest.approx(5.0)  # never a fresh step
    for bad in (0, 5):
        with pytest.raises(ValueError):
            speedup(0.5, 4, 0.1, overlapped=True, fresh_k=bad)
    with pytest.raises(ValueError):
        speedup(0.5, 4, 0.1, fresh_k=2)  # sequential steps are all fresh: no such choice


def test_speedup_with_coverage_by_hand():
    # Half the steps drafted (1.75 tokens for 1.5 units), half plain (1 token for 1 unit): 1.375 / 1.25.
    assert speedup(0.5, 2, 0.25, coverage=0.5) == pytest.approx(1.1)
    assert speedup(0.9, 4, 0.3, coverage=0.0) == 1.0
    assert speedup(0.8, 4, 0.05, coverage=1.0) == speedup(0.8, 4, 0.05)


def test_best_k_by_hand():
    # alpha 0.5, c 0.25: K=0 -> 1, K=1 -> 1.5 / 1.25 = 1.2, K=2 -> 1.75 / 1.5 = 1.167, falling after.
    assert best_k(0.5, 0.25, k_max=8) == (1, pytest.approx(1.2))
    assert best_k(0.0, 0.1) == (0, 1.0)  # never draft when nothing is accepted
    k, s = best_k(0.9, 0.0, k_max=6)
    assert k == 6 and s == pytest.approx((1 - 0.9 ** 7) / 0.1)  # free drafts: the longest K wins


@pytest.mark.parametrize("args", [(-0.1, 2, 0.1), (1.5, 2, 0.1), (0.5, -1, 0.1), (0.5, 2, -0.1), (0.5, 1.5, 0.1)])
def test_bad_inputs_are_refused(args):
    with pytest.raises(ValueError):
        speedup(*args)
