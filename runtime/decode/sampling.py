"""Logit processing shared by target-only decoding, drafters and `verify`.

The order is transformers': repetition penalty (then OpenAI's presence and frequency penalties), then
temperature, top-k, top-p. Using one
implementation everywhere is what makes speculative sampling match target-only sampling.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mirrorsd.config import SamplingParams
from mirrorsd.contracts import TokenLogprob


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


def apply_presence_frequency(logits: torch.Tensor, generated: Sequence[int], draft: Sequence[int],
                             presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's penalties, as vLLM applies them: row i of logits [n, V] loses frequency * count(t) +
    presence * (count(t) > 0) for each token t generated so far (the generated tokens, then draft[:i];
    not the prompt)."""
    if presence == 0.0 and frequency == 0.0:
        return logits
    vocab = logits.shape[-1]
    counts = torch.zeros(vocab, dtype=logits.dtype, device=logits.device)
    ids = [int(t) for t in generated if 0 <= int(t) < vocab]
    if ids:
        counts.index_add_(0, torch.as_tensor(ids, device=logits.device), torch.ones(len(ids), dtype=logits.dtype,
                                                                                    device=logits.device))
    out = logits.clone()
    for i in range(logits.shape[0]):
        if i > 0:
            counts[int(draft[i - 1])] += 1
        out[i] -= counts * frequency + (counts > 0).to(logits.dtype) * presence
    return out


def warp_logits(logits: torch.Tensor, cfg: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on already-penalised logits [n, V]; removed tokens get -inf."""
    logits = logits / cfg.temperature
    vocab = logits.shape[-1]
    if 0 < cfg.top_k < vocab:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]  # [n, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        logits = logits.masked_fill(~top_p_keep(logits, cfg.top_p), float("-inf"))
    if cfg.min_p > 0.0:  # p >= min_p * p_max, compared in probabilities as transformers does
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < cfg.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return logits


def top_p_keep(logits: torch.Tensor, top_p: float, first: int = 256) -> torch.Tensor:
    """The nucleus of each row [n, V] as a bool mask, as transformers' TopPLogitsWarper keeps it (up to
    its float32 rounding at the boundary): a token stays while the mass ranked above it is below top_p (so
    the top token always stays). Found among the
    `first` likeliest tokens, widened until they hold top_p of the mass: sorting all 150k logits of a
    large vocabulary costs ~12 ms per row on a CPU, a partial top-k well under one (docs/measurements.md). Row by
    row: a verify pass's row gets the nucleus a plain step's one row gets, whatever the rows beside it need."""
    probs = logits.softmax(dim=-1)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    vocab = probs.shape[-1]
    for i in range(probs.shape[0]):
        k = min(first, vocab)
        while True:
            top, idx = probs[i].topk(k)  # [k], descending
            if k == vocab or float(top.sum()) >= top_p:
                break  # every token past the k-th has at least top_p of the mass above it
            k = min(vocab, k * 8)
        top = top.double()  # the mass above each token, summed without float32's drift over 150k terms
        keep_sorted = (top.cumsum(dim=-1) - top) < top_p
        keep_sorted[0] = True
        keep[i, idx] = keep_sorted
    return keep


def next_token_scores(
    logits: torch.Tensor, cfg: SamplingParams, history: Sequence[int], draft: Sequence[int] = (), prompt_len: int = 0
) -> torch.Tensor:
    """Greedy: penalised logits (argmax picks the token). Sampling: probabilities [n, V].
    history[prompt_len:] are the generated tokens the presence and frequency penalties count."""
    logits = apply_repetition_penalty(logits.float(), history, draft, cfg.repetition_penalty)
    logits = apply_presence_frequency(logits, history[prompt_len:], draft, cfg.presence_penalty,
                                      cfg.frequency_penalty)
    if cfg.greedy:
        return logits
    return torch.softmax(warp_logits(logits, cfg), dim=-1)


def sample_categorical(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from probs [V] by inverse CDF with one uniform from rng (zero-mass tokens never drawn)."""
    cdf = np.cumsum(probs, dtype=np.float64)
    u = rng.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), len(cdf) - 1))


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> tuple[TokenLogprob, ...]:
    """The target's log-probabilities of the committed tokens and of the `top` likeliest alternatives at each
    position. Row i of logits [k+1, V] is the distribution tokens[i] was chosen from; these are the raw model's
    (before penalties, temperature and grammar masks), as vLLM reports them by default."""
    logp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)  # [n, V]
    chosen = logp.gather(1, torch.as_tensor(tokens, device=logp.device).unsqueeze(1)).squeeze(1).tolist()
    if top > 0:
        values, ids = torch.topk(logp, top, dim=-1)
        alternatives = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        alternatives = [()] * len(tokens)
    return tuple(TokenLogprob(lp, alt) for lp, alt in zip(chosen, alternatives))
