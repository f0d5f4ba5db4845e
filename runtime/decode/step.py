"""The step core: what every decode loop does around one verify step, written once.

A draft provider (loop.py, pipeline.py) decides only *where a draft comes from* and *when*. Everything else
is here: the draft length K, checked drafting with a helper (`CheckedDrafter`), the verify pass and the
lossless `verify` call, committing, the estimators (K schedule, speculation gate) and the `Step` record.
"""

from __future__ import annotations

import logging
import numbers
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mirrorsd.config import GenerationConfig
from mirrorsd.contracts import (CausalLM, Draft, Drafter, ExitRequest, HintOutcome, Step, ThreadControl,
                                TokenLogprob)
from mirrorsd.errors import ModelOutputError
from mirrorsd.runtime.decode import match_classes, verify_curve
from mirrorsd.runtime.decode.policy import StepPolicy
from mirrorsd.runtime.decode.threads import draft_control, leave_signals_to_the_main_thread, pinned
from mirrorsd.runtime.timeline import DRAFT, VERIFY, Timeline
from mirrorsd.rejection import verify
from mirrorsd.sampling import token_logprobs
from mirrorsd.structured import GrammarConstraint, apply_masks

log = logging.getLogger("mirrorsd")


@dataclass(frozen=True)
class Outcome:
    """What one verify pass decided."""

    n_accepted: int
    tokens: list[int]  # accepted draft tokens + the correction or bonus token
    start: float  # perf_counter() when the pass began
    seconds: float  # score() + verify()
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token, when the request asks for them


class StepCore:
    """The request's committed history and the estimators every loop shares."""

    def __init__(self, target: CausalLM, prompt_ids: Sequence[int], config: GenerationConfig,
                 max_new_tokens: int, timeline: Timeline | None = None, overlapped: bool = False,
                 constraint: GrammarConstraint | None = None) -> None:
        self.target, self.config, self.constraint = target, config, constraint
        self.timeline = timeline or Timeline()
        self.rng = np.random.default_rng(config.seed)
        self.committed = list(prompt_ids)
        self.prompt_len = len(self.committed)
        self.max_new_tokens, self.generated = max_new_tokens, 0
        self.policy = StepPolicy(config, overlapped, curve=verify_curve.known(target),
                                 matches=match_classes.shared(target))

    @property
    def done(self) -> bool:
        return self.generated >= self.max_new_tokens

    def step_k(self) -> int:
        """Draft tokens this step may carry (0: a plain decode step). The step commits at most k + 1
        tokens: never draft past max_new_tokens or the context, nor while the gate is closed."""
        return self.policy.draft_length(min(self.max_new_tokens - self.generated - 1,
                                            self.target.max_context - len(self.committed) - 1))

    def prepare(self, draft: Draft, k: int, whole: bool = False) -> Draft:
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
        self.policy.learn(n_drafted, outcome.n_accepted, outcome.tokens, draft_seconds, outcome.seconds,
                          step_seconds, measured, schedule)


class CheckedDrafter:
    """Checked drafting for a loop that drafts between verify steps: the drafter until its first fault (an
    exception, a draft that breaks the contract, or no answer within draft_timeout_s), then the helper,
    then nothing. A fault costs speed, never output; `take_fault()` reports it once, for the step's record.
    Drafters run on a helper thread so that one that hangs can be abandoned (a `bounded` one, whose calls
    return promptly, on the calling thread: a hand-off costs more than its lookup), and see the committed
    history as a tuple: nothing a drafter does can write to it."""

    def __init__(self, drafter: Drafter | None, helper: Drafter | None, config: GenerationConfig,
                 vocab_size: int, timeline: Timeline, core: int | None = None) -> None:
        """core: run the drafter on this CPU core alone (a pinned CoreLayout), else wherever the OS puts it (a
        bounded one runs on the calling thread)."""
        self.config, self.vocab_size, self.timeline = config, vocab_size, timeline
        self.drafter, self.helper, self.core = drafter, helper, core
        self._fault: str | None = None
        self._caller = _caller_for(drafter, core)
        self._start()

    @property
    def active(self) -> bool:
        return self.drafter is not None

    def propose(self, committed: Sequence[int], k: int) -> Draft:
        if self.drafter is None or k <= 0:
            return Draft.empty()
        try:
            with self.timeline.span(DRAFT, f"{self.drafter.name} draft") as span:
                draft = check_draft(self._call(self.drafter.propose, tuple(committed), k), k,
                                    self.vocab_size)
                span["tokens"] = len(draft.tokens)
            return draft
        except Exception as exc:  # a failing drafter costs speed, never output
            self._drop(exc)
            return Draft.empty()

    def accepted(self, committed: Sequence[int], n_accepted: int) -> None:
        """Handed to the drafter's thread without waiting: the next propose() waits for it (the thread runs its
        calls in order) and reports a fault it raised or a hang."""
        if self.drafter is not None:
            self._caller.post(self.drafter.accepted, (tuple(committed), n_accepted))

    def take_fault(self) -> str | None:
        fault, self._fault = self._fault, None
        return fault

    def close(self) -> None:
        if self._caller is not None:
            try:  # let the last feedback finish before the request's end reaches the drafter (Learner.finish)
                self._call(_nothing)
            except Exception:
                pass
            self._caller.close()

    def _call(self, fn, *args):
        return self._caller.call(fn, args, self.config.draft_timeout_s)

    def _drop(self, exc: Exception) -> None:
        self._fault = drop_message(self.drafter, exc)
        self.drafter, self.helper = self.helper, None
        self._caller.close()  # a stuck helper thread is left there; a new one serves the helper
        self._caller = _caller_for(self.drafter, self.core)
        self._start()

    def _start(self) -> None:
        if self.drafter is not None:
            try:
                self._call(self.drafter.start, self.config)
            except Exception as exc:
                self._drop(exc)


def _nothing() -> None:
    pass


def _caller_for(drafter: Drafter | None, core: int | None) -> _Caller | _Direct | None:
    if drafter is None:
        return None
    return _Direct() if drafter.bounded else _Caller(core, draft_control(drafter))


class _Direct:
    """_Caller's contract on the calling thread, for a bounded drafter: a posted call that raises is reported
    by the next call."""

    def __init__(self) -> None:
        self._posted_error: Exception | None = None

    def post(self, fn, args: tuple) -> None:
        if self._posted_error is None:
            try:
                fn(*args)
            except Exception as exc:
                self._posted_error = exc

    def call(self, fn, args: tuple, timeout: float):
        if self._posted_error is not None:
            raise self._posted_error
        return fn(*args)

    def close(self) -> None:
        pass


class _Caller:
    """Runs calls on one daemon thread, in order, and waits for each at most `timeout` seconds. A call that
    overruns raises TimeoutError; its thread is abandoned (never joined), so a hung drafter cannot hang the
    request. A posted call is not waited for: the next call waits behind it, and raises what it raised."""

    def __init__(self, core: int | None = None, control: ThreadControl | None = None) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._posted_error: BaseException | None = None  # the thread's own: read and written there only
        threading.Thread(target=self._loop, args=(core, control), name="mirrorsd-drafter", daemon=True).start()

    def post(self, fn, args: tuple) -> None:
        self._jobs.put((fn, args, None))

    def call(self, fn, args: tuple, timeout: float):
        answer: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs.put((fn, args, answer))
        try:
            ok, value = answer.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no answer within draft_timeout_s = {timeout} s") from None
        if not ok:
            raise value
        return value

    def close(self) -> None:
        self._jobs.put(None)

    def _loop(self, core: int | None, control: ThreadControl | None) -> None:
        leave_signals_to_the_main_thread()
        with pinned(core, control):
            while (job := self._jobs.get()) is not None:
                fn, args, answer = job
                if answer is not None and self._posted_error is not None:
                    answer.put((False, self._posted_error))  # a posted call failed: this one reports it
                    continue
                try:
                    result = fn(*args)
                except BaseException as exc:  # handed to the caller, which drops the drafter
                    if answer is None:
                        self._posted_error = exc
                    else:
                        answer.put((False, exc))
                    continue
                if answer is not None:
                    answer.put((True, result))


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


def make_step(draft: Draft, outcome: Outcome, draft_seconds: float, fault: str | None,
              branch: str | None = None, hint: HintOutcome | None = None) -> Step:
    return Step(outcome.tokens, len(draft.tokens), outcome.n_accepted, draft.source if draft.tokens else "none",
                draft_seconds, outcome.seconds, fault, branch, outcome.logprobs, hint)


def drop_message(drafter: Drafter, exc: Exception) -> str:
    """Log that a drafter is dropped for the rest of the request; the reason, for the stats."""
    reason = f"drafter {drafter.name!r} dropped: {exc}"
    log.warning("%s; continuing without drafting", reason)
    return reason


def check_draft(draft: Draft, max_k: int, vocab_size: int) -> Draft:
    """A draft as the target may trust it, or ValueError: a Draft of at most `max_k` integer token ids in
    the target vocabulary and, when sampled, one row of q per token that is a distribution (finite,
    non-negative, summing to 1 over the target vocabulary, as wide as it up to padding) giving its own token
    a positive probability. Returns it normalised (ids as
    ints, q as float64 [k, V'])."""
    if not isinstance(draft, Draft):
        raise ValueError(f"propose() returned {type(draft).__name__}, not a Draft")
    tokens = draft.tokens.tolist() if isinstance(draft.tokens, np.ndarray) else draft.tokens
    if not isinstance(tokens, (list, tuple)):
        raise ValueError(f"draft tokens are a {type(tokens).__name__}, not a list of ids")
    if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in tokens):
        raise ValueError("draft token ids must be integers")
    tokens = [int(t) for t in tokens]
    k = len(tokens)
    if k > max_k:
        raise ValueError(f"proposed {k} tokens, more than the {max_k} asked for")
    if any(not (0 <= t < vocab_size) for t in tokens):
        raise ValueError(f"proposed token ids outside the target vocabulary [0, {vocab_size})")
    match = draft.match
    if isinstance(match, bool) or not isinstance(match, numbers.Integral) or match < 0:
        raise ValueError(f"draft match length must be an integer >= 0, got {match!r}")
    if draft.probs is None:
        return Draft(tokens, None, str(draft.source), int(match))
    q = np.asarray(draft.probs, dtype=np.float64)
    if q.ndim != 2 or q.shape[0] != k:
        raise ValueError(f"draft probs have shape {q.shape}, not one row per token ({k} rows)")
    if k == 0:
        return Draft([], None, str(draft.source), int(match))
    if abs(q.shape[1] - vocab_size) > vocab_size // VOCAB_PADDING_SHARE:
        raise ValueError(f"draft probs are {q.shape[1]} wide, but the target's vocabulary has {vocab_size} ids "
                         "(a draft with another tokenizer?)")
    sums = q.sum(axis=1)  # NaN or inf anywhere in a row shows here
    kept = q[:, :vocab_size].sum(axis=1)  # a wider row's padding must carry no probability
    if not np.isfinite(sums).all() or q.min() < 0 or np.abs(kept - 1).max() > Q_SUM_TOLERANCE:
        raise ValueError("draft probs are not distributions over the target vocabulary (NaN, inf, negative, "
                         "or rows not summing to 1)")
    if any(t >= q.shape[1] or q[i, t] <= 0 for i, t in enumerate(tokens)):
        raise ValueError("a drafted token has probability 0 under its own draft distribution")
    return Draft(tokens, q, str(draft.source), int(match))


Q_SUM_TOLERANCE = 1e-3  # float32/float16 softmax rows sum to 1 within ~1e-6 / 1e-3
# A draft model may pad its vocabulary to another multiple than the target (qwen2.5: 151936 vs 152064 rows);
# a width further off than 1/64 of the target's is another tokenizer, whose ids mean other tokens.
VOCAB_PADDING_SHARE = 64
