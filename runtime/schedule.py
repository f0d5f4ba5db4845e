"""Draft length K per step."""

from __future__ import annotations

from mirrorsd.config import GenerationConfig


class DraftLengthSchedule:
    """transformers' heuristic: all K accepted -> K += 2; otherwise K -= 1; within [1, max_draft_tokens].
    With adaptive_k off, K stays at num_draft_tokens."""

    def __init__(self, config: GenerationConfig) -> None:
        self.adaptive = config.adaptive_k
        self.max_k = config.max_draft_tokens
        self.k = min(config.num_draft_tokens, self.max_k)

    def update(self, n_drafted: int, n_accepted: int) -> int:
        if self.adaptive and n_drafted > 0 and self.k > 0:
            self.k = min(self.k + 2, self.max_k) if n_accepted == n_drafted else max(self.k - 1, 1)
        return self.k


class SpeculationGate:
    """Turns drafting off while it does not pay, measured, not guessed.

    Compares the throughput of drafted steps (committed tokens / (draft + verify seconds)) with that of
    plain one-token steps, both as moving averages. While drafted steps are slower, drafting pauses
    for `backoff` steps, then one drafted step probes again; each failed probe doubles the pause (up
    to max_backoff), a good one resets it. Until both kinds of step have been measured it drafts.

    Timing-based switching changes which random numbers a sampling run draws, so with a seed the gate
    stays open: a seed must reproduce a run exactly. Output is lossless either way.
    """

    def __init__(self, enabled: bool = True, decay: float = 0.7, min_backoff: int = 8, max_backoff: int = 64) -> None:
        self.enabled = enabled
        self.decay = decay
        self.min_backoff, self.max_backoff = min_backoff, max_backoff
        self.backoff = min_backoff
        self.paused_for = 0
        self.drafted_rate: float | None = None  # tokens per second of drafted steps
        self.plain_rate: float | None = None  # tokens per second of plain steps
        self.probing = False  # the next drafted step ends a pause

    def should_draft(self) -> bool:
        if not self.enabled or self.paused_for == 0:
            return True
        self.paused_for -= 1
        return self.paused_for == 0  # the step after the pause is a probe

    def record(self, drafted: bool, tokens: int, seconds: float) -> None:
        if not self.enabled or seconds <= 0:
            return
        rate = tokens / seconds
        if not drafted:
            self.plain_rate = self._ema(self.plain_rate, rate)
            return
        # A probe measures drafting afresh; otherwise drafted steps feed the moving average.
        self.drafted_rate = rate if self.probing else self._ema(self.drafted_rate, rate)
        if self.plain_rate is not None and self.drafted_rate < self.plain_rate:
            if self.probing:
                self.backoff = min(self.backoff * 2, self.max_backoff)
            self.paused_for, self.probing = self.backoff, True
        else:
            self.backoff, self.probing = self.min_backoff, False

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new
