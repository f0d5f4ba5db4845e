"""A plain numpy reference of logit processing and speculative verification, written independently
of mirrorsd.runtime.decode.sampling / mirrorsd.runtime.decode.verify, for the tests to compare against."""

from __future__ import annotations

import numpy as np


def process(logits: np.ndarray, history, temperature, top_k=0, top_p=1.0, penalty=1.0) -> np.ndarray:
    """One row: penalty, then (if temperature > 0) probabilities after temperature/top-k/top-p."""
    x = logits.astype(np.float64).copy()
    for t in set(int(h) for h in history):
        x[t] = x[t] * penalty if x[t] < 0 else x[t] / penalty
    if temperature == 0:
        return x
    x = x / temperature
    if top_k:
        kth = np.sort(x)[-top_k]
        x[x < kth] = -np.inf
    if top_p < 1.0:
        order = np.argsort(x, kind="stable")  # ascending
        e = np.exp(x[order] - x[order].max())
        cum = np.cumsum(e / e.sum())
        drop = cum <= 1 - top_p
        drop[-1] = False
        x[order[drop]] = -np.inf
    e = np.exp(x - x.max())
    return e / e.sum()


def draw(probs: np.ndarray, u: float) -> int:
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), len(probs) - 1))


def verify_reference(tokens, q, logits, history, rng, temperature, top_k=0, top_p=1.0, penalty=1.0,
                     skip_residual=False):
    """Returns (n_accepted, new_tokens). skip_residual=True is a deliberately wrong variant that draws
    corrections from p instead of norm(max(0, p - q)); the statistical test must catch it."""
    k = len(tokens)
    rows = [process(logits[i], list(history) + list(tokens[:i]), temperature, top_k, top_p, penalty)
            for i in range(k + 1)]
    if temperature == 0:
        n = 0
        while n < k and tokens[n] == int(np.argmax(rows[n])):
            n += 1
        return n, list(tokens[:n]) + [int(np.argmax(rows[n]))]
    if q is None:  # one-hot drafts: target-only's draws, accepted while they equal the draft
        for i, x in enumerate(tokens):
            drawn = draw(rows[i], rng.random())
            if drawn != x:
                return i, list(tokens[:i]) + [drawn]
        return k, list(tokens) + [draw(rows[k], rng.random())]
    for i, x in enumerate(tokens):
        p = rows[i]
        qi = q[i]
        if qi[x] > 0 and rng.random() < min(1.0, p[x] / qi[x]):
            continue
        residual = p if skip_residual else np.maximum(p - qi, 0)
        if residual.sum() <= 0:
            residual = p
        return i, list(tokens[:i]) + [draw(residual, rng.random())]
    return k, list(tokens) + [draw(rows[k], rng.random())]
