"""verify: the one place the lossless guarantee lives.

Greedy (temperature 0): accept draft tokens while they equal the target's argmax; the first
mismatch is replaced by the target's argmax (the *correction*); if all K match, the target's
argmax after them is the *bonus* token. The committed text is exactly greedy target decoding.

Sampling: Leviathan et al. 2023 / Chen et al. 2023 speculative sampling. Draft token x_i (drawn
from q_i) is accepted with probability min(1, p_i(x_i) / q_i(x_i)); on the first rejection the
correction is drawn from the residual norm(max(0, p_i - q_i)); if all K are accepted the bonus is
drawn from p_K. Every committed token is then distributed exactly as target-only sampling.

p is the target's distribution after the same penalty/temperature/top-k/top-p processing the
target-only path uses (mirrorsd.sampling). q = None means one-hot drafts (n-gram, retrieval).
Random numbers come from a numpy Generator in a fixed order (one uniform per accept test, one per
draw) so a seed reproduces a run on any device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mirrorsd.config import SamplingParams
from mirrorsd.contracts import Draft
from mirrorsd.sampling import next_token_scores, sample_categorical


def verify(
    draft: Draft,
    target_logits: torch.Tensor,
    sampling: SamplingParams,
    rng: np.random.Generator,
    history: Sequence[int] = (),
    prompt_len: int = 0,
) -> tuple[int, list[int]]:
    """Returns (n_accepted, new_tokens): new_tokens = draft.tokens[:n_accepted] + [correction or bonus].

    target_logits: [k+1, V] raw target logits; row i follows history + draft.tokens[:i].
    history: the committed tokens before the draft (for the repetition penalty); the tokens from
    prompt_len on are the generated ones (for the presence and frequency penalties).
    """
    k = len(draft.tokens)
    assert target_logits.shape[0] == k + 1, (target_logits.shape, k)
    scores = next_token_scores(target_logits, sampling, history, draft.tokens, prompt_len)  # [k+1, V]

    if sampling.greedy:
        target_ids = scores.argmax(dim=-1).tolist()  # [k+1]
        n = 0
        while n < k and draft.tokens[n] == target_ids[n]:
            n += 1
        return n, list(draft.tokens[:n]) + [target_ids[n]]

    p = scores.double().cpu().numpy()  # [k+1, V]
    for i, x in enumerate(draft.tokens):
        q_i = None if draft.probs is None else _fit_width(draft.probs[i], p.shape[-1])  # [V]; None: q = one-hot x
        q_x = 1.0 if q_i is None else float(q_i[x])
        if q_x > 0 and rng.random() < min(1.0, float(p[i, x]) / q_x):
            continue  # accepted
        return i, list(draft.tokens[:i]) + [_recovered(p[i], q_i, x, rng)]
    return k, list(draft.tokens) + [sample_categorical(p[k], rng)]  # every token accepted: the bonus token


def _recovered(p_i: np.ndarray, q_i: np.ndarray | None, x: int, rng: np.random.Generator) -> int:
    """The token drawn where draft token x was rejected: from the residual norm(max(0, p - q)) (q one-hot at x when
    the drafter gave no distribution)."""
    if q_i is None:
        residual = p_i.copy()
        residual[x] = 0.0
    else:
        residual = np.maximum(p_i - q_i, 0.0)
    if residual.sum() <= 0.0:  # p == q (up to rounding): the residual is undefined; use p.
        residual = p_i
    return sample_categorical(residual, rng)


def _fit_width(q: np.ndarray, vocab: int) -> np.ndarray:
    """A draft vocabulary may be padded differently from the target's; align q to [vocab]."""
    q = np.asarray(q, dtype=np.float64)
    if q.shape[-1] == vocab:
        return q
    if q.shape[-1] > vocab:
        return q[:vocab]
    return np.pad(q, (0, vocab - q.shape[-1]))
