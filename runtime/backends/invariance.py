"""Batch invariance: does a verify pass give every position the very logits one-token decoding gives?

Speculation is lossless only if it is. The check decodes a token sequence one token at a time (the
reference), then, for several cache offsets and prefill chunkings, scores the positions after each
offset in one pass of n = 1..17 positions and compares every row with the reference, bit for bit.
Used by the backends' tests, `mirrorsd devices --check` and bench.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

log = logging.getLogger("mirrorsd")

# P, the rows of every pass on a fixed-shape backend (torch-static, llama.cpp's fixed_rows): a verify pass of up to
# K = 15 drafted tokens is one pass (on a GPU, about one step's cost)
FIXED_ROWS = 16
# check_fixed_shape's passes, named in a kept verdict's key (runtime/backends/__init__.py): a new check, new verdicts
FIXED_CHECK = "fixed-shape check 2"
DEFAULT_SIZES = tuple(range(1, 18))  # positions per verify pass: K + 1 for K = 0..16
DEFAULT_CHUNKS = (0, 5)  # prefill the prefix in one batch (0), or in batches of 5 positions


@dataclass(frozen=True)
class InvarianceReport:
    """max |logit difference| between batched and one-token scoring, over every case tried."""

    backend: str
    max_abs_diff: float
    by_size: dict[int, float] = field(default_factory=dict)  # pass size n -> worst |diff| over the cases
    offsets: tuple[int, ...] = ()
    chunks: tuple[int, ...] = ()

    @property
    def exact(self) -> bool:
        return self.max_abs_diff == 0.0

    def summary(self) -> str:
        if self.exact:
            return (f"{self.backend}: batch-invariant (max |diff| 0 over passes of "
                    f"{min(self.by_size)}-{max(self.by_size)} positions at offsets {list(self.offsets)})")
        inexact = sorted(n for n, d in self.by_size.items() if d > 0)
        return (f"{self.backend}: NOT batch-invariant: max |logit diff| {self.max_abs_diff:.4g}, "
                f"passes of {inexact[0]}+ positions differ (n = {inexact})")


def reference_logits(lm, tokens: list[int], positions: Iterable[int], length: int = 0) -> dict[int, torch.Tensor]:
    """Logits after tokens[:p + 1] for each wanted p, decoding one token at a time; where `tokens` is shorter
    than `length`, it is extended (in place) with the greedy tokens of that decoding."""
    wanted, out = set(positions), {}
    lm.reset()
    for p in range(max(max(wanted) + 1, length - 1)):
        row = lm.score(tokens[:p + 1])[-1]
        if p in wanted:
            out[p] = row.detach().float().cpu().clone()
        if len(tokens) == p + 1 < length:
            tokens.append(int(row.argmax()))
    lm.reset()
    return out


def prefill(lm, tokens: Sequence[int], length: int, chunk: int) -> None:
    """Put tokens[:length] in the cache, in one batch (chunk 0) or in batches of `chunk` positions."""
    lm.reset()
    step = chunk or length
    for end in range(step, length + step, step):
        lm.score(tokens[:min(end, length)])


def check_batch_invariance(lm, tokens: Sequence[int], offsets: Sequence[int], sizes: Sequence[int] = DEFAULT_SIZES,
                           chunks: Sequence[int] = DEFAULT_CHUNKS) -> InvarianceReport:
    """Compare every row of passes of `sizes` positions after each offset (its prefix prefilled in each
    of `chunks`) with one-token decoding. `tokens` may be a prompt: the one-token decoding continues it
    greedily to max(offsets) + max(sizes) tokens. offsets >= 1."""
    tokens = [int(t) for t in tokens]
    need = max(offsets) + max(sizes)
    if not tokens or min(offsets) < 1:
        raise ValueError(f"need at least one token and offsets >= 1, got {len(tokens)} tokens, offsets {list(offsets)}")
    ref = reference_logits(lm, tokens, {o - 1 + j for o in offsets for j in range(max(sizes))}, need)
    by_size = dict.fromkeys(sizes, 0.0)
    for offset in offsets:
        for chunk in chunks:
            # the pass for (offset, n) scores positions offset-1 .. offset+n-2 with the last committed
            # token fed in the same batch as the n-1 drafted ones, as a verify step does
            prefill(lm, tokens, offset - 1, chunk) if offset > 1 else lm.reset()
            for n in sizes:
                rows = lm.score(tokens[:offset], tokens[offset:offset + n - 1]).float().cpu()  # [n, V]
                diff = max(float((rows[j] - ref[offset - 1 + j]).abs().max()) for j in range(n))
                by_size[n] = max(by_size[n], diff)
    lm.reset()
    return InvarianceReport(lm.backend, max(by_size.values()), by_size,
                            tuple(offsets), tuple(chunks))


def check_fixed_shape(lm, rows: int) -> bool:
    """The check for a backend whose every pass has `rows` rows (torch-static, llama.cpp's fixed_rows): passes of
    1..rows+1 positions (the last one spans two passes) at two offsets, after whole and chunked prefills, and at a
    third where the context allows: 257 - rows, whose passes read 256 cache cells while their rows' one-token
    references read more (llama.cpp pads the cells a pass attends to to a multiple of 256, and a GPU's attention
    may divide its work by that count); a failure is logged with its summary."""
    offsets = (1, rows + 3) + ((257 - rows,) if 258 <= lm.max_context else ())
    report = check_batch_invariance(lm, probe_tokens(lm.vocab_size, 8), offsets=offsets,
                                    sizes=tuple(range(1, rows + 2)))
    if not report.exact:
        log.warning("%s", report.summary())
    return report.exact


def probe_tokens(vocab: int, n: int) -> list[int]:
    """A fixed token sequence spread over the vocabulary, to start a check without a tokenizer."""
    return [(i * 7919 + 13) % vocab for i in range(n)]


def greedy_tokens(lm, prompt: Sequence[int], n: int) -> list[int]:
    """prompt + n greedy tokens, one-token decoding: a realistic sequence to check invariance on."""
    tokens = [int(t) for t in prompt]
    lm.reset()
    for _ in range(n):
        tokens.append(int(lm.score(tokens)[-1].argmax()))
    lm.reset()
    return tokens
