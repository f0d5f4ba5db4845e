"""The verify step: one target pass over the draft, the accept rule, the commit.

`DecodeState` is what every draft provider (loop.py, pipeline/) shares around one verify step: the draft
length K (the policy's), the draft as the step verifies it (`prepare`: grammar clip, match-class cut), the
target's pass and `verify` (`DecodeState.verify`), `commit` and the estimators' update (`learn`).

`verify` is the accept rule, the one place the lossless guarantee lives (a pure function).

Greedy (temperature 0): accept draft tokens while they equal the target's argmax; the first
mismatch is replaced by the target's argmax (the *correction*); if all K match, the target's
argmax after them is the *bonus* token. The committed text is exactly greedy target decoding.

Sampling, a model's draft: Leviathan et al. 2023 / Chen et al. 2023 speculative sampling. Draft token x_i
(drawn from q_i) is accepted with probability min(1, p_i(x_i) / q_i(x_i)); on the first rejection the
correction is drawn from the residual norm(max(0, p_i - q_i)); if all K are accepted the bonus is
drawn from p_K. Every committed token is then distributed exactly as target-only sampling.

Sampling, a one-hot draft (q = None: n-gram, retrieval, greedy drafting): each position draws its token from
p_i exactly as a plain step would (one uniform, inverse CDF), and the draft token is accepted while it equals
the draw; the first draw that differs is the correction, and after K equal ones the next draw is the bonus.
That is the rule above for a one-hot q (accepted with probability p_i(x_i); a rejection draws from p_i without
x_i), and it spends one uniform per committed token, as target-only decoding does: with a seed, a run gives
target-only's tokens whatever is drafted, whenever, at any length.

p is the target's distribution after the same penalty/temperature/top-k/top-p processing the
target-only path uses (mirrorsd.runtime.decode.sampling). Random numbers come from a numpy Generator in a
fixed order (a model's draft: one uniform per accept test, one per draw; a one-hot draft: one per draw) so a
seed reproduces a run on any device.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mirrorsd.config import GenerationConfig, SamplingParams
from mirrorsd.contracts import CausalLM, Draft, ExitRequest, HintOutcome, Step, TokenLogprob
from mirrorsd.errors import ModelOutputError
from mirrorsd.runtime.decode.grammar import GrammarConstraint, apply_masks
from mirrorsd.runtime.decode.policy import match_classes, verify_curve
from mirrorsd.runtime.decode.policy.step_policy import StepPolicy
from mirrorsd.runtime.decode.sampling import next_token_scores, sample_categorical, token_logprobs
from mirrorsd.runtime.timeline import VERIFY, Timeline


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
    if draft.probs is None:  # one-hot: draw as target-only decoding does, accept while the draft agrees
        for i, x in enumerate(draft.tokens):
            drawn = sample_categorical(p[i], rng)
            if drawn != x:
                return i, list(draft.tokens[:i]) + [drawn]  # the correction
        return k, list(draft.tokens) + [sample_categorical(p[k], rng)]  # the bonus token
    for i, x in enumerate(draft.tokens):
        q_i = _fit_width(draft.probs[i], p.shape[-1])  # [V]
        q_x = float(q_i[x])
        if q_x > 0 and rng.random() < min(1.0, float(p[i, x]) / q_x):
            continue  # accepted
        return i, list(draft.tokens[:i]) + [_recovered(p[i], q_i, rng)]
    return k, list(draft.tokens) + [sample_categorical(p[k], rng)]  # every token accepted: the bonus token


def _recovered(p_i: np.ndarray, q_i: np.ndarray, rng: np.random.Generator) -> int:
    """The token drawn where a draft token was rejected: from the residual norm(max(0, p - q))."""
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


@dataclass(frozen=True)
class Outcome:
    """What one verify pass decided."""

    accepted_tokens: int
    tokens: list[int]  # accepted draft tokens + the correction or bonus token
    start: float  # perf_counter() when the pass began
    verify_time_s: float  # score() + verify()
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token, when the request asks for them


class DecodeState:
    """One request's decoding: its committed history, sampling stream, grammar and the estimators; every
    provider's steps go through `verify` and `commit` here. model_drafts: the drafter runs a model, whose drafts
    may carry a distribution q (StepPolicy)."""

    def __init__(self, target: CausalLM, prompt_ids: Sequence[int], config: GenerationConfig,
                 max_new_tokens: int, timeline: Timeline | None = None, overlapped: bool = False,
                 constraint: GrammarConstraint | None = None, model_drafts: bool = True) -> None:
        self.target, self.config, self.constraint = target, config, constraint
        self.timeline = timeline or Timeline()
        self.rng = np.random.default_rng(config.seed)
        self.committed = list(prompt_ids)
        self.prompt_len = len(self.committed)
        self.max_new_tokens, self.generated = max_new_tokens, 0
        self.policy = StepPolicy(config, overlapped, curve=verify_curve.known(target),
                                 matches=match_classes.shared(target), model_drafts=model_drafts)

    @property
    def done(self) -> bool:
        return self.generated >= self.max_new_tokens

    def step_k(self) -> int:
        """Draft tokens this step may carry (0: a plain decode step). The step commits at most k + 1
        tokens: never draft past max_new_tokens or the context, nor while the gate is closed."""
        return self.policy.draft_length(min(self.max_new_tokens - self.generated - 1,
                                            self.target.max_context - len(self.committed) - 1))

    def fit(self, draft: Draft, k: int, whole: bool = False) -> Draft:
        """The draft as this step verifies it: under a grammar (structured output), up to its first token the
        grammar forbids, or the tokens the grammar forces next where those are more; then a model-free draft cut
        to the length its match class pays for against a plain step (StepPolicy.fit; whole: not cut)."""
        if self.constraint is not None:
            draft = self._constrain(draft, k)
        return self.policy.fit(draft, whole)

    def _constrain(self, draft: Draft, k: int) -> Draft:
        tokens = self.constraint.clip(draft.tokens) if draft.tokens else []
        forced = self.constraint.forced(k)
        if len(forced) > len(tokens):
            return Draft(forced, None, "grammar")
        probs = None if draft.probs is None else draft.probs[: len(tokens)]
        return draft if len(tokens) == len(draft.tokens) else Draft(tokens, probs, draft.source, draft.match)

    def verify(self, draft: Draft, exit_request: ExitRequest | None = None) -> Outcome:
        """Score the draft in one target pass (publishing early-exit hints if asked) and verify it against the
        target's distribution, masked by the request's grammar if it has one."""
        with self.timeline.span(VERIFY, "verify", k=len(draft.tokens)) as span:
            start = time.perf_counter()
            if exit_request is None:
                logits = self.target.score(self.committed, draft.tokens)  # [k+1, V]
            else:
                logits = self.target.early_exit.score_with_exit(self.committed, draft.tokens, exit_request)
            if self.generated == 0:  # the request's first pass: damaged weights show at once
                check_logits(logits, self.target)
            allowed = logits if self.constraint is None else apply_masks(logits, self.constraint.masks(draft.tokens))
            n_accepted, tokens = verify(draft, allowed, self.config.sampling, self.rng, history=self.committed,
                                        prompt_len=self.prompt_len)
            span["accepted"] = n_accepted
        top = self.config.logprobs
        return Outcome(n_accepted, tokens, start, time.perf_counter() - start,
                       None if top is None else token_logprobs(logits, tokens, top))

    def commit(self, outcome: Outcome) -> None:
        self.committed.extend(outcome.tokens)
        self.generated += len(outcome.tokens)
        if self.constraint is not None:
            self.constraint.advance(outcome.tokens)

    def learn(self, n_drafted: int, draft_seconds: float, outcome: Outcome, step_seconds: float,
              schedule: bool = True) -> None:
        """Feed the policy after commit(). schedule=False: the step was served by a drafter other than the one
        the K schedule describes (the pipeline's model-free helper)."""
        measured = self.generated > len(outcome.tokens)  # the first step carries the prompt prefill
        self.policy.learn(n_drafted, outcome.accepted_tokens, outcome.tokens, draft_seconds, outcome.verify_time_s,
                          step_seconds, measured, schedule)


def check_logits(logits, target: CausalLM) -> None:
    """Logits [n, V] a model can have produced: finite, and not all equal in a row (ModelOutputError otherwise)."""
    rows = logits.float()
    finite = bool(rows.isfinite().all())
    if not finite or bool((rows.amax(-1) == rows.amin(-1)).any()):
        what = "NaN or infinite" if not finite else "all equal"
        raise ModelOutputError(
            f"the target ({target.backend}) produced logits that are {what}: its weights are damaged (a corrupted "
            "model file) or the backend overflowed; nothing was generated",
            "re-fetch the model (a catalog model: `mirrorsd rm NAME`, then `mirrorsd pull NAME`), or try another "
            "--dtype / --backend")


def make_step(draft: Draft, outcome: Outcome, draft_seconds: float, fallback: str | None,
              branch: str | None = None, hint: HintOutcome | None = None) -> Step:
    return Step(outcome.tokens, len(draft.tokens), outcome.accepted_tokens, draft.source if draft.tokens else "none",
                draft_seconds, outcome.verify_time_s, fallback, branch, outcome.logprobs, hint)
