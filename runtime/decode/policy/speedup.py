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

With `fresh_k` = F < K the step after a miss does not wait for K fresh tokens: it verifies the first F
(F*c + 1 units for E[tokens](F)) while the worker drafts on, so the step after it can find K ready
again (PEARL's "pre-verify", arXiv 2408.11850, taken further). Steps then alternate between two states,
*steady* (K tokens ready, max(K*c, 1) units, stays steady with probability alpha^(K+1)) and *fresh*
(F*c + 1 units, turns steady with probability alpha^(F+1)); the speedup is the ratio of the stationary
mixture's tokens to its cost. F = K is the formula above.

Model-free drafters (n-gram, retrieval) often have nothing to propose; with `coverage` = the share of
steps that carry a draft, the other steps are plain decode steps (1 token for 1 unit), and the speedup
is the ratio of the mixture's tokens to its cost (coverage=1, the default, is Leviathan's formula).

`growth` models a verify pass that grows with K (on a CPU it does): verify costs 1 + growth*K units.
`verify_cost`, where given, is the measured curve instead: the pass over K drafted tokens costs
verify_cost(K) units (not assumed monotone: a kernel that starts at 4 rows can make K+1 = 4 cost no more
than K+1 = 2). With growth = 0 these are upper bounds to check against a measured run; the K schedule
(runtime/decode/policy/schedule.py) follows the target's measured curve.
"""

from __future__ import annotations

from collections.abc import Callable

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


VerifyCost = Callable[[int], float]
"""The verify pass over K drafted tokens, in plain target steps (1 at K = 0)."""


def linear(growth: float) -> VerifyCost:
    return lambda k: 1.0 + growth * k


def step_cost(alpha: float, k: int, c: float, overlapped: bool = False, growth: float = 0.0,
              verify_cost: VerifyCost | None = None) -> float:
    """Wall time of one drafted step in target-step units (see the module docstring; fresh steps of K)."""
    v = verify_cost or linear(growth)
    if not overlapped:
        return v(k) + k * c
    return _overlapped_mix(alpha, k, c, v, k)[1]  # with fresh_k = k: hit * max(...) + miss * (...)


def _overlapped_mix(alpha: float, k: int, c: float, v: VerifyCost, fresh_k: int) -> tuple[float, float]:
    """(tokens, cost) of the mean overlapped step when a step after a miss verifies fresh_k tokens."""
    steady_hit, fresh_hit = alpha ** (k + 1), alpha ** (fresh_k + 1)
    # stationary share of fresh steps: steady -> fresh with 1 - steady_hit, fresh -> steady with fresh_hit
    fresh = (1.0 - steady_hit) / (1.0 - steady_hit + fresh_hit) if steady_hit < 1.0 else 0.0
    tokens = (1 - fresh) * expected_tokens_per_step(alpha, k) + fresh * expected_tokens_per_step(alpha, fresh_k)
    cost = (1 - fresh) * max(v(k), k * c) + fresh * (v(fresh_k) + fresh_k * c)
    return tokens, cost


def speedup(alpha: float, k: int, c: float, overlapped: bool = False, coverage: float = 1.0,
            growth: float = 0.0, fresh_k: int | None = None, verify_cost: VerifyCost | None = None) -> float:
    """Expected wall-time speedup over target-only decoding (Leviathan's formula).

    overlapped=False: drafting then verifying, a step costs k*c + 1 target steps.
    overlapped=True: drafting runs alongside verification (see step_cost).
    coverage: share of steps with a draft (the rest are plain decode steps); 1 = Leviathan's formula.
    growth: extra verify cost per draft token, in target-step units.
    verify_cost: the measured pass cost per K in target steps (replaces 1 + growth*K).
    fresh_k: overlapped only, the draft length of a step after a miss (None: k; see the module docstring).
    """
    _check(alpha, k, c)
    if not 0.0 <= coverage <= 1.0:
        raise ValueError(f"coverage must be in [0, 1], got {coverage}")
    if fresh_k is not None and not (overlapped and 1 <= fresh_k <= max(k, 1) and int(fresh_k) == fresh_k):
        raise ValueError(f"fresh_k must be in [1, k] and overlapped, got {fresh_k} for k={k}")
    v = verify_cost or linear(growth)
    if overlapped:
        drafted, drafted_cost = _overlapped_mix(alpha, k, c, v, k if fresh_k is None else fresh_k)
    else:
        drafted, drafted_cost = expected_tokens_per_step(alpha, k), v(k) + k * c
    return (coverage * drafted + (1.0 - coverage)) / (coverage * drafted_cost + (1.0 - coverage))


def best_k(alpha: float, c: float, k_max: int = 16, overlapped: bool = False,
           coverage: float = 1.0) -> tuple[int, float]:
    """The K in 0..k_max with the highest predicted speedup, and that speedup (K=0: do not draft)."""
    return max(((k, speedup(alpha, k, c, overlapped, coverage)) for k in range(k_max + 1)), key=lambda kv: kv[1])
