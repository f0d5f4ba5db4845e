"""Checked drafting: a drafter's calls guarded so that nothing it does can change the output.

`CheckedDrafter` runs the drafter (on a drafting thread unless its calls are `bounded`), checks each draft against
the contract (`check_draft`), and on the first fault -- an exception, a draft that breaks the contract, no
answer within draft_timeout_s -- drops it for the request and hands over to the helper drafter.
"""

from __future__ import annotations

import logging
import numbers
import queue
import threading
from collections.abc import Sequence

import numpy as np

from mirrorsd.config import GenerationConfig
from mirrorsd.contracts import Draft, Drafter, ThreadControl
from mirrorsd.runtime.decode.pipeline.threads import draft_control, leave_signals_to_the_main_thread, pinned
from mirrorsd.runtime.timeline import DRAFT, Timeline

log = logging.getLogger("mirrorsd")


class CheckedDrafter:
    """Checked drafting for a loop that drafts between verify steps: the drafter until its first fault (an
    exception, a draft that breaks the contract, or no answer within draft_timeout_s), then the helper,
    then nothing. A fault costs speed, never output; `take_fallback()` reports it once, for the step's record.
    Drafters run on a drafting thread so that one that hangs can be abandoned (a `bounded` one, whose calls
    return promptly, on the calling thread: a hand-off costs more than its lookup), and see the committed
    history as a tuple: nothing a drafter does can write to it."""

    def __init__(self, drafter: Drafter | None, helper: Drafter | None, config: GenerationConfig,
                 vocab_size: int, timeline: Timeline, core: int | None = None) -> None:
        """core: run the drafter on this CPU core alone (a pinned CoreLayout), else wherever the OS puts it (a
        bounded one runs on the calling thread)."""
        self.config, self.vocab_size, self.timeline = config, vocab_size, timeline
        self.drafter, self.helper, self.core = drafter, helper, core
        self._fallback: str | None = None
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
            self._fall_back(exc)
            return Draft.empty()

    def accepted(self, committed: Sequence[int], n_accepted: int) -> None:
        """Handed to the drafter's thread without waiting: the next propose() waits for it (the thread runs its
        calls in order) and reports a fault it raised or a hang."""
        if self.drafter is not None:
            self._caller.post(self.drafter.accepted, (tuple(committed), n_accepted))

    def take_fallback(self) -> str | None:
        fallback, self._fallback = self._fallback, None
        return fallback

    def close(self) -> None:
        if self._caller is not None:
            try:  # let the last feedback finish before the request's end reaches the drafter (Learner.finish)
                self._call(_nothing)
            except Exception:
                pass
            self._caller.close()

    def _call(self, fn, *args):
        return self._caller.call(fn, args, self.config.draft_timeout_s)

    def _fall_back(self, exc: Exception) -> None:
        self._fallback = fallback_message(self.drafter, exc)
        self.drafter, self.helper = self.helper, None
        self._caller.close()  # a stuck drafting thread is left there; a new one serves the helper drafter
        self._caller = _caller_for(self.drafter, self.core)
        self._start()

    def _start(self) -> None:
        if self.drafter is not None:
            try:
                self._call(self.drafter.start, self.config)
            except Exception as exc:
                self._fall_back(exc)


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


def fallback_message(drafter: Drafter, exc: Exception) -> str:
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
