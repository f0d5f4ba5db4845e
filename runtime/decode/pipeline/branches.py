"""Mirror-SD branch planning, pure: which (rejection point, correction) branches to draft during a pass.

The verify pass publishes, at layer l_e, the top-kappa tokens of each of its k+1 rows (a `Hint`); with
branch_source "draft", the target sends the draft model's own top-kappa at each drafted position instead,
as the pass starts. With p~ that distribution, the step reaches draft position i with probability
prod_{j<i} p~_j(draft_j) and then commits x != draft_i with probability p~_i(x). Position k (every
draft token accepted) is a branch point too, for bonus tokens other than the lookahead's own guess.
The draft worker drafts the likeliest branches, as many tokens as the rest of the pass affords. A draft is
sure of its own tokens (it chose them), so with its candidates the step reaches position i with
probability alpha^i (the measured acceptance rate), is rejected there with 1 - alpha, and the
alternatives share that in proportion to their draft probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_BRANCH_SCORE = 0.02  # branches less likely than this (by early-exit estimate) are not drafted


@dataclass(frozen=True)
class Hint:
    """Early-exit candidates of the step being verified (verify worker -> draft worker)."""

    base_len: int  # committed length when the step began
    draft: tuple[int, ...]  # the k tokens under verification
    top_ids: np.ndarray  # [rows, kappa] top tokens at layer l_e (or the draft's), row i predicts position
    # base_len + i; rows is k+1, or k when the draft's candidates for the bonus position are not known yet
    top_logp: np.ndarray  # [rows, kappa] their log-probabilities
    deadline: float  # perf_counter() time the verify pass is expected to end
    branch_k: int  # draft at most this many tokens per branch
    alpha: float | None = None  # the draft's candidates: where the step ends comes from the measured
    # acceptance rate instead (a draft is sure of its own tokens), which candidate from their probabilities


@dataclass
class Branch:
    """A hypothesis for the step's outcome and the draft prepared for it."""

    score: float  # early-exit probability that the step ends here
    context: list[int]  # committed + draft[:at] + [correction], then the branch's drafted tokens
    at: int  # draft tokens [0, at) accepted ...
    correction: int  # ... then the target commits this token
    left: int  # tokens still to draft on this branch
    base_len: int  # the step it belongs to


@dataclass(frozen=True)
class BranchPlan:
    branches: list[Branch]  # best first
    lookahead_score: float  # early-exit probability that the step lands on the lookahead itself


def plan_branches(hint: Hint, seq: list[int], token_seconds: float | None, now: float) -> BranchPlan:
    """Rank the step's branches by early-exit probability and keep those the rest of the pass can pay
    for: (deadline - now) / token_seconds tokens in all, shared among the chosen branches.

    seq: the draft worker's committed history + lookahead (its own bonus guess at base_len + k, if any)."""
    k, base = len(hint.draft), hint.base_len
    own_bonus = seq[base + k] if len(seq) > base + k and seq[base:base + k] == list(hint.draft) else None
    reach, candidates, lookahead_score = 1.0, [], 0.0
    for i in range(min(k + 1, len(hint.top_ids))):
        ids, probs = hint.top_ids[i].tolist(), np.exp(hint.top_logp[i])
        own = hint.draft[i] if i < k else own_bonus
        if hint.alpha is not None:  # P(reach i) = alpha^i, P(reject there) = 1 - alpha, shared by the others
            mass = sum(float(p) for x, p in zip(ids, probs) if x != own) or 1.0
            probs = probs * (1.0 - hint.alpha) / mass
        for x, p in zip(ids, probs):
            if x != own:
                candidates.append(Branch(reach * float(p), list(seq[:base]) + list(hint.draft[:i]) + [x], i, x, 0, base))
        own_p = float(probs[ids.index(own)]) if own in ids else 0.0
        if hint.alpha is not None:
            own_p = hint.alpha
        if i < k:
            reach *= own_p
        elif own is not None:
            lookahead_score = reach * own_p
    if own_bonus is None or len(hint.top_ids) <= k:  # no guess or no candidates at the bonus position yet:
        lookahead_score = reach * (hint.alpha if hint.alpha is not None else 1.0)  # (at most) all k pass
    candidates = sorted((c for c in candidates if c.score >= MIN_BRANCH_SCORE), key=lambda c: -c.score)
    affordable = int((hint.deadline - now) / token_seconds) if token_seconds else 0
    chosen = candidates[: max(0, min(len(candidates), affordable))]
    for c in chosen:
        c.left = max(1, min(hint.branch_k, affordable // len(chosen)))
    return BranchPlan(chosen, lookahead_score)
