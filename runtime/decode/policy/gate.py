"""The speculation gate: drafting is switched off while it measurably does not pay."""

from __future__ import annotations

from dataclasses import dataclass

from mirrorsd.runtime.decode.policy.estimates import Ema


class SpeculationGate:
    """Turns drafting off while it does not pay, measured, not guessed.

    Compares the throughput of drafted steps (committed tokens / (draft + verify seconds)) with that of
    plain one-token steps, each as a ratio of moving averages (tokens over seconds, so one unlucky step
    that commits a single token after a long draft does not swing the rate). While drafted steps are
    slower, drafting pauses for `backoff` steps; then a probe of `probe_steps` drafted steps measures
    drafting afresh; a failed probe doubles the pause (up to max_backoff), a good one resets it. Until
    both kinds of step have been measured it drafts, except that a drafter which always proposes gets
    one plain step after `measure_plain_after` drafted ones, so there is a plain rate to compare with.
    (The loops do not record a request's first step: it carries the prompt prefill.) The K schedule's
    cost model may pause drafting sooner (`pause`), where it predicts a loss at every K.

    Where a model's drafts are verified, timing-based switching changes which random numbers a sampling run
    draws, so with a seed the gate stays open there: a seed must reproduce a run exactly (schedule.timing_free).
    Output is lossless either way.
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
        self._drafted = _Rate(decay)  # drafted steps
        self._plain = _Rate(decay)  # plain steps
        self._probe: _Probe | None = None

    @property
    def drafted_rate(self) -> float | None:
        return self._drafted.rate

    @property
    def plain_rate(self) -> float | None:
        return self._plain.rate

    def should_draft(self) -> bool:
        if not self.enabled:
            return True
        if self._plain.rate is None and self.drafted_steps >= self.measure_plain_after:
            return False  # measure one plain step
        if self.paused_for == 0:
            return True
        self.paused_for -= 1
        if self.paused_for == 0:
            self._probe = _Probe(steps_left=self.probe_steps)
        return self.paused_for == 0

    def pause(self) -> None:
        """Pause drafting now (the cost model predicts a loss at every K); a probe measures it afresh
        later, as after a measured loss. Ignored during a probe, which the measured rates judge."""
        if self.enabled and self.paused_for == 0 and self._probe is None:
            self.paused_for = self.backoff

    def record(self, drafted: bool, tokens: int, seconds: float) -> None:
        if not self.enabled or seconds <= 0:
            return
        if not drafted:
            self._plain.add(tokens, seconds)
            return
        self.drafted_steps += 1
        if self._probe is not None:  # a probe: judge drafting on these steps alone
            self._probe.tokens += tokens
            self._probe.seconds += seconds
            self._probe.steps_left -= 1
            if self._probe.steps_left > 0:
                return
            self._drafted = _Rate(self.decay, self._probe.tokens, self._probe.seconds)
            self._probe = None
            probed = True
        else:
            self._drafted.add(tokens, seconds)
            probed = False
        if self._plain.rate is not None and self.drafted_rate < self.plain_rate:
            if probed:
                self.backoff = min(self.backoff * 2, self.max_backoff)
            self.paused_for = self.backoff
        elif probed:
            self.backoff = self.min_backoff


class _Rate:
    """Tokens per second as a ratio of two moving averages."""

    def __init__(self, decay: float, tokens: float | None = None, seconds: float | None = None) -> None:
        self.tokens, self.seconds = Ema(decay, tokens), Ema(decay, seconds)

    def add(self, tokens: float, seconds: float) -> None:
        self.tokens.update(tokens)
        self.seconds.update(seconds)

    @property
    def rate(self) -> float | None:
        return None if self.seconds.value is None else self.tokens.value / self.seconds.value


@dataclass
class _Probe:
    """Drafted steps measured afresh after a pause."""

    steps_left: int
    tokens: float = 0.0
    seconds: float = 0.0
