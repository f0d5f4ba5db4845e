"""Logit processing shared by target-only decoding, drafters and `verify`.

The order is transformers': repetition penalty, then temperature, top-k, top-p. Using one
implementation everywhere is what makes speculative sampling match target-only sampling.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mirrorsd.config import SamplingParams


def apply_repetition_penalty(
    logits: torch.Tensor, history: Sequence[int], draft: Sequence[int], penalty: float
) -> torch.Tensor:
    """Row i of logits [n, V] sees the context history + draft[:i]; penalise tokens seen there."""
    if penalty == 1.0:
        return logits
    out = logits.clone()
    seen = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    if len(history):
        seen[torch.as_tensor(list(history), device=logits.device)] = True
    for i in range(logits.shape[0]):
        if i > 0:
            seen[int(draft[i - 1])] = True
        row = out[i]
        penalised = torch.where(row < 0, row * penalty, row / penalty)
        out[i] = torch.where(seen, penalised, row)
    return out


def warp_logits(logits: torch.Tensor, cfg: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p on already-penalised logits [n, V]; removed tokens get -inf."""
    logits = logits / cfg.temperature
    vocab = logits.shape[-1]
    if 0 < cfg.top_k < vocab:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]  # [n, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        # As transformers' TopPLogitsWarper: drop the low tail whose mass is <= 1 - top_p, keep >= 1.
        sorted_logits, sorted_idx = torch.sort(logits, descending=False, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - cfg.top_p)
        remove_sorted[..., -1:] = False
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def next_token_scores(
    logits: torch.Tensor, cfg: SamplingParams, history: Sequence[int], draft: Sequence[int] = ()
) -> torch.Tensor:
    """Greedy: penalised logits (argmax picks the token). Sampling: probabilities [n, V]."""
    logits = apply_repetition_penalty(logits.float(), history, draft, cfg.repetition_penalty)
    if cfg.greedy:
        return logits
    return torch.softmax(warp_logits(logits, cfg), dim=-1)


def sample_categorical(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from probs [V] by inverse CDF with one uniform from rng (zero-mass tokens never drawn)."""
    cdf = np.cumsum(probs, dtype=np.float64)
    u = rng.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), len(cdf) - 1))
