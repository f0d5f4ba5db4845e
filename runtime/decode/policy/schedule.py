"""Draft length K per step: the deterministic heuristic, or the cost-aware choice from measured costs."""

from __future__ import annotations

from mirrorsd.config import GenerationConfig
from mirrorsd.runtime.decode.policy.estimates import AcceptanceEstimate, Ema
from mirrorsd.runtime.decode.policy.speedup import VerifyCost, speedup


class DraftLengthSchedule:
    """transformers' heuristic: all K accepted -> K += 2; otherwise K -= 1; within [1, max_draft_tokens].
    With adaptive_k off, K stays at num_draft_tokens."""

    def __init__(self, config: GenerationConfig) -> None:
        self.adaptive = config.adaptive_k
        self.max_k = config.max_draft_tokens
        self.k = min(config.num_draft_tokens, self.max_k)
        self.acceptance = AcceptanceEstimate()  # kept for the pipeline's branch decisions, not for K

    @property
    def fresh_k(self) -> int:
        return self.k  # a step after a miss waits for a whole draft, as the inline loop does

    prefill_alone = False  # the first step drafts like every other (reproducible)

    def observe(self, n_drafted: int, draft_seconds: float, verify_seconds: float) -> None:
        pass  # timing plays no part here: K depends on acceptance alone (reproducible)

    def pays(self) -> bool | None:
        return None  # no cost model: the gate's measured rates alone decide

    def verify_costs(self, n: int) -> list[float] | None:
        return None  # timing plays no part

    def update(self, n_drafted: int, n_accepted: int) -> int:
        self.acceptance.update(n_drafted, n_accepted)
        if self.adaptive and n_drafted > 0 and self.k > 0:
            self.k = min(self.k + 2, self.max_k) if n_accepted == n_drafted else max(self.k - 1, 1)
        return self.k


class CostAwareSchedule:
    """K per step from measured costs: the k in [1, max_draft_tokens] with the highest predicted
    speedup (runtime/decode/policy/speedup.py), given the running acceptance estimate alpha and the measured cost
    ratio c.

    alpha comes from an AcceptanceEstimate. Costs are moving averages of the measured draft time per
    token and of the verify time per K (`VerifyCosts`): the target's own curve, whatever its shape (on
    llama.cpp's CPU kernels a pass over 4 positions can cost less than one over 3), starting from the
    curve measured for this target (`curve`, runtime/decode/policy/verify_curve.py) where there is one.
    Until costs are measured it behaves like DraftLengthSchedule's starting K.

    Overlapped, K is also kept where drafting fits inside the verify pass (K c <= verify cost): past
    that point the formula gains little (the step becomes draft-bound) while the two workers, sharing
    memory bandwidth, both slow down (docs/measurements.md). Overlapped, `fresh_k` is chosen with K: how
    many tokens a step after a miss waits for before its pass starts (speedup.py).
    """

    def __init__(self, config: GenerationConfig, overlapped: bool = False, decay: float = 0.9,
                 curve: tuple[float, ...] | None = None) -> None:
        self.max_k = config.max_draft_tokens
        self.k = min(config.num_draft_tokens, self.max_k)
        # Before costs are measured a step after a miss waits for one token, not K: the target idles least.
        self.fresh_k = 1 if overlapped else self.k
        self.overlapped = overlapped
        # Overlapped, the request's first step verifies no draft: the target's prompt prefill, the longest
        # pass, runs while the draft worker prefills and drafts the next step's tokens.
        self.prefill_alone = overlapped
        self.decay = decay
        self.acceptance = AcceptanceEstimate(decay)
        self.draft_per_token = Ema(decay)
        self.verify = VerifyCosts(decay, curve)
        self._pays: bool | None = None

    def costs(self) -> tuple[float, VerifyCost] | None:
        """(c, verify cost per K), both in plain steps, or None before anything is measured."""
        plain = self.verify.plain_seconds()
        if plain is None or self.draft_per_token.value is None:
            return None
        return self.draft_per_token.value / plain, self.verify.ratio

    def verify_costs(self, n: int) -> list[float] | None:
        """The verify pass over K = 0..n drafted tokens in plain steps, as far as it is known (None before any
        pass is measured and without a prior curve)."""
        return self.verify.ratios(n) if self.verify.seconds or self.verify.prior else None

    def observe(self, n_drafted: int, draft_seconds: float, verify_seconds: float) -> None:
        """Timings of one step: the drafting that produced its n_drafted tokens, and its verify pass."""
        if n_drafted > 0 and draft_seconds > 0:
            self.draft_per_token.update(draft_seconds / n_drafted)
        self.verify.add(n_drafted, verify_seconds)

    def pays(self) -> bool | None:
        """Whether some K is predicted to beat a plain step at the acceptance and costs of the last update
        (None before the costs are measured). On a backend whose verify pass grows steeply with K (llama.cpp
        on a CPU: K=1 costs ~1.8 plain steps) a drafter accepted rarely loses at every K."""
        return self._pays

    def update(self, n_drafted: int, n_accepted: int) -> int:
        """Scores every (K, fresh_k) choice once: fresh_k = K sequentially, any fresh_k <= K overlapped."""
        self.acceptance.update(n_drafted, n_accepted)
        costs = self.costs()
        if costs is not None:
            c, cost = costs
            ratios = self.verify.ratios(self.max_k)  # once per update, not per choice scored
            v = ratios.__getitem__
            alpha = self.acceptance.alpha
            ks = range(1, self.max_k + 1)
            choices = [(k, f) for k in ks for f in range(1, k + 1)] if self.overlapped else [(k, None) for k in ks]
            score = {kf: speedup(alpha, kf[0], c, self.overlapped, fresh_k=kf[1], verify_cost=v) for kf in choices}
            self._pays = max(score.values()) >= 1.0
            if self.overlapped:  # drafting must fit inside the verify pass it hides behind
                choices = [(k, f) for k, f in choices if k * c <= v(k)] or [(1, 1)]
            k, f = max(choices, key=score.__getitem__)
            self.k, self.fresh_k = k, f or k
        return self.k


class VerifyCosts:
    """Verify-pass seconds per K (draft tokens) as moving averages, and the pass cost per K in plain steps.

    A K measured in this request costs its own average; another K costs the prior curve's ratio (the
    target's curve measured once, runtime/decode/policy/verify_curve.py) or, without one, a least-squares line
    through the measured passes. The plain step is the K = 0 average, else inferred from the prior or
    the line."""

    def __init__(self, decay: float, prior: tuple[float, ...] | None = None) -> None:
        self.decay, self.prior = decay, prior
        self.seconds: dict[int, Ema] = {}
        self._fit = _LinearFit(decay)

    def add(self, k: int, seconds: float) -> None:
        self.seconds.setdefault(k, Ema(self.decay)).update(seconds)
        self._fit.add(k, seconds)

    def _prior(self, k: int) -> float | None:
        return self.prior[k] if self.prior is not None and k < len(self.prior) else None

    def plain_seconds(self) -> float | None:
        if not self.seconds:
            return None
        if 0 in self.seconds:
            return self.seconds[0].value
        scaled = [ema.value / self._prior(k) for k, ema in self.seconds.items() if self._prior(k)]
        return sum(scaled) / len(scaled) if scaled else self._fit.line()[0]

    def ratios(self, n: int) -> list[float]:
        """The pass over k = 0..n drafted tokens in plain steps (1 at k = 0), the plain step worked out once."""
        if not self.seconds:  # nothing measured yet: the prior curve, extended along its last slope
            last = len(self.prior) - 1
            slope = self.prior[last] - self.prior[max(last - 1, 0)]
            return [1.0] + [self.prior[min(k, last)] + max(0, k - last) * slope for k in range(1, n + 1)]
        plain, line, out = self.plain_seconds(), None, [1.0]
        for k in range(1, n + 1):
            if k in self.seconds:
                out.append(self.seconds[k].value / plain)
            elif self._prior(k) is not None:
                out.append(self._prior(k))
            else:
                line = line or self._fit.line()
                out.append((line[0] + line[1] * k) / plain)
        return out

    def ratio(self, k: int) -> float:
        """The pass over k drafted tokens in plain steps (1 at k = 0)."""
        return self.ratios(k)[k]


class _LinearFit:
    """Least-squares line t = a + b*k over decayed samples (the verify time as K grows)."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.w = self.k = self.kk = self.t = self.kt = 0.0  # decayed sums of 1, k, k*k, t, k*t

    def add(self, k: float, t: float) -> None:
        d = self.decay
        self.w, self.k, self.kk = d * self.w + 1, d * self.k + k, d * self.kk + k * k
        self.t, self.kt = d * self.t + t, d * self.kt + k * t

    def line(self) -> tuple[float, float]:
        """(a, b), with b >= 0 and a > 0."""
        mean_k, mean_t = self.k / self.w, self.t / self.w
        var_k = self.kk / self.w - mean_k ** 2
        b = max(0.0, (self.kt / self.w - mean_k * mean_t) / var_k) if var_k > 1e-6 else 0.0
        return max(mean_t - b * mean_k, 1e-9), b


def timing_free(config: GenerationConfig, model_drafts: bool = True) -> bool:
    """Whether timing must not steer any choice of a request: seeded sampling (its random stream must give the
    same tokens on any machine) where drafts carry a model's distribution q, whose accept tests spend the stream
    by draft (verify.py). One-hot drafts (a model-free drafter: model_drafts=False) spend it as target-only
    decoding does, whatever is drafted."""
    return config.reproducible and model_drafts


def uses_cost_schedule(config: GenerationConfig, model_drafts: bool = True) -> bool:
    """Whether K follows measured costs. Not where K must not depend on timing: fixed K (adaptive_k off)
    and timing_free requests."""
    return config.adaptive_k and not timing_free(config, model_drafts)


def make_schedule(config: GenerationConfig, overlapped: bool = False, curve: tuple[float, ...] | None = None,
                  model_drafts: bool = True) -> DraftLengthSchedule | CostAwareSchedule:
    """The cost-aware schedule (from the target's measured `curve` where known) where K may follow
    measured costs (uses_cost_schedule), else the deterministic heuristic."""
    if not uses_cost_schedule(config, model_drafts):
        return DraftLengthSchedule(config)
    return CostAwareSchedule(config, overlapped, curve=curve)
