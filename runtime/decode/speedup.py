"""Leviathan et al.'s speculative-decoding speedup model (arXiv 2211.17192, section 3), in one place.

With a per-token acceptance rate `alpha` (each drafted token accepted with probability alpha, given
the ones before it were), K drafted tokens per verify step and a draft cost ratio `c` (time of one
draft token / time of one target decode step), one verify step commits on average

    E[tokens per step] = (1 - alpha^(K+1)) / (1 - alpha)

and costs K*c + 1 target-step units when drafting and verification run one after the other, so

    speedup = (1 - alpha^(K+1)) / ((1 - alpha) * (K*c + 1)).

Overlapped (the two-queue pipeline: the draft for step t+1 is computed while the target verifies
step t), a step that lands on the lookahead (all K accepted and the bonus token guessed, probability
alpha^(K+1)) costs max(K*c, 1): the draft hid behind verification. Any other step leaves the next
draft to be made afresh after it, costing K*c + 1 as sequentially, so

    cost_overlapped = alpha^(K+1) * max(K*c, 1) + (1 - alpha^(K+1)) * (K*c + 1).

Model-free drafters (n-gram, retrieval) often have nothing to propose; with `coverage` = the share of
steps that carry a draft, the other steps are plain decode steps (1 token for 1 unit), and the speedup
is the ratio of the mixture's tokens to its cost (coverage=1, the default, is Leviathan's formula).

`growth` models a verify pass that grows with K (on a CPU it does: docs/measurements.md): verify
costs 1 + growth*K units. With growth = 0 these are upper bounds to check against a measured run; the
K schedule (runtime/decode/schedule.py) fits growth from measured verify times.
"""

from __future__ import annotations

__all__ = ["best_k", "expected_tokens_per_step", "speedup", "step_cost"]


def _check(alpha: float, k: int, c: float = 0.0) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if k < 0 or int(k) != k:
        raise ValueError(f"k must be a non-negative integer, got {k}")
    if c < 0:
        raise ValueError(f"the cost ratio c must be >= 0, got {c}")


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Mean tokens committed per verify step: (1 - alpha^(k+1)) / (1 - alpha); k + 1 when alpha = 1."""
    _check(alpha, k)
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def step_cost(alpha: float, k: int, c: float, overlapped: bool = False, growth: float = 0.0) -> float:
    """Wall time of one drafted step in target-step units (see the module docstring)."""
    verify_cost = 1.0 + growth * k
    if not overlapped:
        return verify_cost + k * c
    hit = alpha ** (k + 1)
    return hit * max(verify_cost, k * c) + (1.0 - hit) * (verify_cost + k * c)


def speedup(alpha: float, k: int, c: float, overlapped: bool = False, coverage: float = 1.0,
            growth: float = 0.0) -> float:
    """Expected wall-time speedup over target-only decoding (Leviathan's formula).

    overlapped=False: drafting then verifying, a step costs k*c + 1 target steps.
    overlapped=True: drafting runs alongside verification (see step_cost).
    coverage: share of steps with a draft (the rest are plain decode steps); 1 = Leviathan's formula.
    growth: extra verify cost per draft token, in target-step units.
    """
    _check(alpha, k, c)
    if not 0.0 <= coverage <= 1.0:
        raise ValueError(f"coverage must be in [0, 1], got {coverage}")
    tokens = coverage * expected_tokens_per_step(alpha, k) + (1.0 - coverage)
    return tokens / (coverage * step_cost(alpha, k, c, overlapped, growth) + (1.0 - coverage))


def best_k(alpha: float, c: float, k_max: int = 16, overlapped: bool = False,
           coverage: float = 1.0) -> tuple[int, float]:
    """The K in 0..k_max with the highest predicted speedup, and that speedup (K=0: do not draft)."""
    return max(((k, speedup(alpha, k, c, overlapped, coverage)) for k in range(k_max + 1)), key=lambda kv: kv[1])
