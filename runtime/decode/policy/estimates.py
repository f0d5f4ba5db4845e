"""The running estimates the decode loops keep: one small moving average, and per-token acceptance."""

from __future__ import annotations


class Ema:
    """Exponential moving average; `value` is None until the first sample."""

    def __init__(self, decay: float, value: float | None = None) -> None:
        self.decay = decay
        self.value = value

    def update(self, sample: float) -> float:
        self.value = sample if self.value is None else self.decay * self.value + (1 - self.decay) * sample
        return self.value


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
