"""Draft length K per step."""

from __future__ import annotations

from mirrorsd.config import GenerationConfig
from mirrorsd.runtime.decode.speedup import speedup


class DraftLengthSchedule:
    """transformers' heuristic: all K accepted -> K += 2; otherwise K -= 1; within [1, max_draft_tokens].
    With adaptive_k off, K stays at num_draft_tokens."""

    def __init__(self, config: GenerationConfig) -> None:
        self.adaptive = config.adaptive_k
        self.max_k = config.max_draft_tokens
        self.k = min(config.num_draft_tokens, self.max_k)

    def observe(self, n_drafted: int, draft_seconds: float, verify_seconds: float) -> None:
        pass  # timing plays no part here: K depends on acceptance alone (reproducible)

    def update(self, n_drafted: int, n_accepted: int) -> int:
        if self.adaptive and n_drafted > 0 and self.k > 0:
            self.k = min(self.k + 2, self.max_k) if n_accepted == n_drafted else max(self.k - 1, 1)
        return self.k


class SpeculationGate:
    """Turns drafting off while it does not pay, measured, not guessed.

    Compares the throughput of drafted steps (committed tokens / (draft + verify seconds)) with that of
    plain one-token steps, each as a ratio of moving averages (tokens over seconds, so one unlucky step
    that commits a single token after a long draft does not swing the rate). While drafted steps are
    slower, drafting pauses for `backoff` steps; then a probe of `probe_steps` drafted steps measures
    drafting afresh; a failed probe doubles the pause (up to max_backoff), a good one resets it. Until
    both kinds of step have been measured it drafts, except that a drafter which always proposes gets
    one plain step after `measure_plain_after` drafted ones, so there is a plain rate to compare with.
    (The loops do not record a request's first step: it carries the prompt prefill.)

    Timing-based switching changes which random numbers a sampling run draws, so with a seed the gate
    stays open: a seed must reproduce a run exactly. Output is lossless either way.
    """

    def __init__(self, enabled: bool = True, decay: float = 0.7, min_backoff: int = 8, max_backoff: int = 64,
                 measure_plain_after: int = 3, probe_steps: int = 3) -> None:
        self.enabled = enabled
        self.decay = decay
        self.min_backoff, self.max_backoff = min_backoff, max_backoff
        self.backoff = min_backoff
        self.paused_for = 0
        self.measure_plain_after, self.probe_steps = measure_plain_after, probe_steps
        self.drafted_steps = 0
        self._drafted: list[float] | None = None  # moving averages [tokens, seconds] of drafted steps
        self._plain: list[float] | None = None  # the same for plain steps
        self._probe: list[float] | None = None  # [tokens, seconds, steps left] while probing

    @property
    def drafted_rate(self) -> float | None:
        return self._drafted[0] / self._drafted[1] if self._drafted else None

    @property
    def plain_rate(self) -> float | None:
        return self._plain[0] / self._plain[1] if self._plain else None

    def should_draft(self) -> bool:
        if not self.enabled:
            return True
        if self._plain is None and self.drafted_steps >= self.measure_plain_after:
            return False  # measure one plain step
        if self.paused_for == 0:
            return True
        self.paused_for -= 1
        if self.paused_for == 0:
            self._probe = [0.0, 0.0, self.probe_steps]
        return self.paused_for == 0

    def record(self, drafted: bool, tokens: int, seconds: float) -> None:
        if not self.enabled or seconds <= 0:
            return
        if not drafted:
            self._plain = self._ema(self._plain, tokens, seconds)
            return
        self.drafted_steps += 1
        if self._probe is not None:  # a probe: judge drafting on these steps alone
            self._probe[0] += tokens
            self._probe[1] += seconds
            self._probe[2] -= 1
            if self._probe[2] > 0:
                return
            self._drafted, self._probe = [self._probe[0], self._probe[1]], None
            probed = True
        else:
            self._drafted = self._ema(self._drafted, tokens, seconds)
            probed = False
        if self._plain is not None and self.drafted_rate < self.plain_rate:
            if probed:
                self.backoff = min(self.backoff * 2, self.max_backoff)
            self.paused_for = self.backoff
        elif probed:
            self.backoff = self.min_backoff

    def _ema(self, old: list[float] | None, tokens: float, seconds: float) -> list[float]:
        if old is None:
            return [tokens, seconds]
        d = self.decay
        return [d * old[0] + (1 - d) * tokens, d * old[1] + (1 - d) * seconds]


class AcceptanceEstimate:
    """Running per-token acceptance alpha: accepted / (accepted + rejections) over recent steps, the
    maximum-likelihood estimate of a geometric acceptance model (a fully accepted step adds no
    rejection). Starts at 0.5 with the weight of one step."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.accepted = self.rejected = 1.0

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def update(self, n_drafted: int, n_accepted: int) -> None:
        if n_drafted > 0:
            self.accepted = self.decay * self.accepted + n_accepted
            self.rejected = self.decay * self.rejected + (n_accepted < n_drafted)


class CostAwareSchedule:
    """K per step from measured costs: the k in [1, max_draft_tokens] with the highest predicted
    speedup (runtime/speedup.py), given the running acceptance estimate alpha and the measured cost
    ratio c.

    alpha comes from an AcceptanceEstimate. Costs are
    moving averages of the measured draft time per token and of the verify time, fitted as
    t_verify(k) = a + b*k so that a CPU target, whose verify pass grows with k, is not over-fed.
    Until costs are measured it behaves like DraftLengthSchedule's starting K.

    Overlapped, K is also kept where drafting fits inside the verify pass (K c <= verify cost): past
    that point the formula gains little (the step becomes draft-bound) while the two workers, sharing
    memory bandwidth, both slow down; measured on a 2-core CPU, K = 16 with c = 0.14 ran 25% slower
    than K = 8.
    """

    def __init__(self, config: GenerationConfig, overlapped: bool = False, decay: float = 0.9) -> None:
        self.max_k = config.max_draft_tokens
        self.k = min(config.num_draft_tokens, self.max_k)
        self.overlapped = overlapped
        self.decay = decay
        self.acceptance = AcceptanceEstimate(decay)
        self.draft_per_token: float | None = None
        self._fit = [0.0] * 5  # decayed sums of w, k, k*k, t, k*t for t_verify = a + b*k

    def costs(self) -> tuple[float, float] | None:
        """(c, growth) relative to a plain pass, or None before anything is measured."""
        w, sk, skk, st, skt = self._fit
        if w == 0 or self.draft_per_token is None:
            return None
        mean_k, mean_t = sk / w, st / w
        var_k = skk / w - mean_k ** 2
        b = max(0.0, (skt / w - mean_k * mean_t) / var_k) if var_k > 1e-6 else 0.0
        a = max(mean_t - b * mean_k, 1e-9)
        return self.draft_per_token / a, b / a

    def observe(self, n_drafted: int, draft_seconds: float, verify_seconds: float) -> None:
        """Timings of one step: the drafting that produced its n_drafted tokens, and its verify pass."""
        d = self.decay
        if n_drafted > 0 and draft_seconds > 0:
            per_token = draft_seconds / n_drafted
            self.draft_per_token = per_token if self.draft_per_token is None else d * self.draft_per_token + (1 - d) * per_token
        self._fit = [d * s for s in self._fit]
        for i, v in enumerate((1.0, n_drafted, n_drafted * n_drafted, verify_seconds, n_drafted * verify_seconds)):
            self._fit[i] += v

    def update(self, n_drafted: int, n_accepted: int) -> int:
        self.acceptance.update(n_drafted, n_accepted)
        costs = self.costs()
        if costs is not None:
            c, growth = costs
            alpha = self.acceptance.alpha
            candidates = range(1, self.max_k + 1)
            if self.overlapped:  # drafting must fit inside the verify pass it hides behind
                candidates = [k for k in candidates if k * c <= 1.0 + growth * k] or [1]
            self.k = max(candidates, key=lambda k: speedup(alpha, k, c, self.overlapped, growth=growth))
        return self.k


def make_schedule(config: GenerationConfig, overlapped: bool = False) -> DraftLengthSchedule | CostAwareSchedule:
    """The cost-aware schedule, except where K must not depend on timing: fixed K (adaptive_k off) and
    seeded sampling, whose random stream must be reproducible, use the deterministic heuristic."""
    if not config.adaptive_k or (config.seed is not None and not config.greedy):
        return DraftLengthSchedule(config)
    return CostAwareSchedule(config, overlapped)
