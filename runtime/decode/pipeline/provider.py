"""The Mirror-SD two-queue pipeline: drafting overlaps verification.

Two workers, each owning its device: the **draft worker** (worker.py, a thread that owns the drafter)
and the **verify worker** (the thread iterating the loop with a PipelinedProvider, which owns the target). They talk
through two queues and pass only token ids, a few top-k log-probs and draft distributions.

The draft worker keeps a *lookahead* drafted as if every step were fully accepted: while the target
verifies step t (the first K lookahead tokens), the worker already drafts step t+1. With early exit
(Mirror-SD), the verify pass publishes its layer-l_e top-kappa tokens midway, and the worker drafts the
likeliest (rejection point, correction) *branches* in the time the pass has left (branches.py). With
branch_source "draft" (a draft model with a ranking), the candidates are the draft model's own top-kappa at each
drafted position, sent as the pass starts: the target computes nothing extra and the worker has the whole
pass. Each hinted step is measured against its hint (Step.hint: was the correction a candidate, was its
branch ready).

After each step the target reconciles. If the committed history is still a prefix of the lookahead,
the rest of the lookahead is the next draft (Advance). If the outcome landed on a prepared branch, that
branch is the next draft (Rebase with it). Otherwise everything drafted past the divergence is stale and
the worker starts again from the committed history (Rebase). The step after that does not wait for a
whole draft: it verifies the first `fresh_k` tokens the worker sends (the K schedule picks fresh_k from
measured costs) while the worker drafts on, so the target idles for a short draft only and the step
after it finds the lookahead full again. The request's first step waits for none: the target's prompt
prefill runs while the worker prefills the draft and drafts the second step.

Per step, the model-free `helper` drafter (run inline) may serve instead, when its draft, made at
once, promises more tokens per second than waiting for the lookahead; it takes over for good when the
pipelined drafter fails, returns garbage or times out (it is then dropped for the rest of the request).

Lossless: only `verify` commits tokens, through the same verify step as the inline loop (verify.py's DecodeState). Drafts made
ahead of time are conditioned on the same context as drafts made afresh; which ones get used depends
only on that context and the target's own randomness, so a seeded run reproduces the inline loop
token for token (see ModelDrafter's context-keyed random stream).
"""

from __future__ import annotations

import logging
import time

from mirrorsd.contracts import Draft, Drafter, ExitRequest, HintOutcome
from mirrorsd.runtime.decode.pipeline.branches import Hint
from mirrorsd.runtime.decode.policy.estimates import AcceptanceEstimate, Ema
from mirrorsd.runtime.decode.pipeline.lookahead import Lookahead, StepBranches, drain, fill
from mirrorsd.runtime.decode.plan import DecodePlan
from mirrorsd.runtime.decode.drafting import CheckedDrafter, fallback_message
from mirrorsd.runtime.decode.verify import DecodeState, Outcome
from mirrorsd.runtime.decode.pipeline.threads import CoreSharing
from mirrorsd.runtime.decode.pipeline.worker import Advance, DraftWorker, Rebase

log = logging.getLogger("mirrorsd")

class PipelinedProvider:
    """The verify worker's side of one request (a loop.DraftProvider): the draft worker and the lookahead it
    fills, the model-free helper, the early-exit plan and the CPU threads."""

    def __init__(self, state: DecodeState, drafter: Drafter | None, helper: Drafter | None, plan: DecodePlan) -> None:
        config, target = state.config, state.target
        threads, draft_core = plan.threads, plan.draft_core
        self.state, self.draft_core = state, draft_core
        self.helper = CheckedDrafter(helper, None, config, target.vocab_size, state.timeline, draft_core)
        self.look = Lookahead()
        self.fresh = True  # the lookahead was (re)started from the committed history since the last draft
        self.verify_seconds = Ema(0.7)
        self.helper_acceptance = AcceptanceEstimate()  # the helper's, on the steps it served
        self.branch_source, self.exit_layer = plan.branch_source, plan.exit_layer
        self.hint: Hint | None = None  # this step's, once sent to the worker
        self.helper_served = False  # this step's draft is the helper's
        self.fallback: str | None = None
        self.worker: DraftWorker | None = None
        self.sharing: CoreSharing | None = None
        self.saved_threads = target.threads.get_threads() if threads and target.threads else None
        if drafter is not None:
            self._start_worker(drafter, threads)

    # -- the provider's steps -----------------------------------------------------------------------

    def draft(self) -> tuple[Draft, ExitRequest | None]:
        k = self.state.step_k()
        draft, self.helper_served = self.pick_draft(k)
        # A helper draft was weighed against waiting for the lookahead, not against a plain step: verified whole.
        draft = self.state.fit(draft, k, whole=self.helper_served)
        return draft, self.early_exit(draft, self.helper_served)

    def learn(self, draft: Draft, outcome: Outcome, waited: float) -> tuple[str | None, HintOutcome | None]:
        self.update_estimates(draft, self.helper_served, outcome, waited)  # first: the worker drafts for the new K
        return self.reconcile(outcome)

    def pick_draft(self, k: int) -> tuple[Draft, bool]:
        """This step's draft, and whether the helper made it: the lookahead (waiting
        for it if needed), the helper's draft where it pays, or, without a worker, the helper's."""
        if k <= 0:
            return Draft.empty(), False
        if self.worker is not None:
            helper_draft = self._helper_draft(k)
            if helper_draft is not None:
                return helper_draft, True
            draft = self._lookahead_draft(k)
            if self.worker is not None:
                return draft, False
        return self.helper.propose(self.state.committed, k), False

    def early_exit(self, draft: Draft, helper_served: bool) -> ExitRequest | None:
        """When the step is likely to leave the lookahead, send the worker its branch candidates: the draft's
        own at once (branch_source "draft"), or the pass's early-exit top-kappa midway (the ExitRequest)."""
        self.hint = None
        if (self.worker is None or not self.branch_source or not draft.tokens or helper_served
                or not self.state.policy.wants_branches(len(draft.tokens))):
            return None
        worker, config = self.worker, self.state.config
        hint_args = (len(self.state.committed), tuple(draft.tokens),
                     time.perf_counter() + (self.verify_seconds.value or 0.0), max(1, self.state.policy.schedule.k))

        def publish(ids, logp, alpha: float | None = None) -> None:
            base, drafted, deadline, branch_k = hint_args
            self.hint = Hint(base, drafted, ids, logp, deadline, branch_k, alpha)
            worker.draft_queue.put(self.hint)

        if self.branch_source == "draft":
            k = len(draft.tokens)
            candidates = self.look.candidates(k) if self.look.tokens[:k] == draft.tokens else None
            if candidates is not None:
                publish(*candidates, alpha=self.state.policy.branch_alpha())
            return None
        return ExitRequest(self.exit_layer, config.branch_width, publish)

    def reconcile(self, outcome: Outcome) -> tuple[str | None, HintOutcome | None]:
        """After commit(): tell the worker where the step landed (Advance on the lookahead, Rebase
        elsewhere, onto a prepared branch if one matches). Returns "hit"/"miss" for hinted steps that
        left the lookahead, and for every hinted step how it ended against its hint."""
        self.helper.accepted(self.state.committed, outcome.accepted_tokens)
        if self.worker is None:
            return None, None
        new, committed, hint = outcome.tokens, self.state.committed, self.hint
        base = len(committed) - len(new)
        branches = drain(self.worker, self.look, base, base if hint else None)
        record = self._measure(hint, outcome, branches) if hint else None
        limit = self._limit(self.state.policy.schedule.k)
        if self.look.tokens[:len(new)] == new:
            self.look.advance(len(new))
            self.worker.draft_queue.put(Advance(len(committed), limit, outcome.accepted_tokens))
            return None, record
        diverged = any(a != b for a, b in zip(self.look.tokens, new))  # not merely short
        hit = branches.get((outcome.accepted_tokens, new[-1]))
        self.look.rebase(hit)
        self.fresh = hit is None
        self.worker.draft_queue.put(Rebase(self.look.epoch, tuple(committed), tuple(self.look.tokens), limit,
                                           outcome.accepted_tokens))
        return ("hit" if hit else "miss") if hint and (hit or diverged) else None, record

    def _measure(self, hint: Hint, outcome: Outcome, branches: StepBranches) -> HintOutcome:
        """A hinted step against its hint: was the correction a candidate at its position, and how far was
        the worker with the branches (its plan, and the branch for this outcome) when the pass had ended."""
        at, correction = outcome.accepted_tokens, outcome.tokens[-1]
        covered = at < len(hint.top_ids) and correction in hint.top_ids[at].tolist()
        return HintOutcome(self.branch_source, at if at < len(hint.draft) else None, correction, covered,
                           branches.state((at, correction)),
                           None if branches.planned is None else len(branches.planned), branches.ready)

    def update_estimates(self, draft: Draft, helper_served: bool, outcome: Outcome, waited: float) -> None:
        """The estimators (the steps the helper served feed only the helper's acceptance)."""
        if self.state.generated > len(outcome.tokens):  # the first step carries the prompt prefill
            self.verify_seconds.update(outcome.verify_time_s)
        n_drafted = len(draft.tokens)
        if helper_served:
            self.helper_acceptance.update(n_drafted, outcome.accepted_tokens)
        # The worker drafted while the target verified: its cost is its own drafting time, not the wait.
        cost = n_drafted * (self.worker.token_seconds.value or 0.0) if self.worker and not helper_served else waited
        self.state.learn(n_drafted, cost, outcome, waited + outcome.verify_time_s, schedule=not helper_served)

    def take_fallback(self) -> str | None:
        fallback, self.fallback = self.fallback or self.helper.take_fallback(), None
        return fallback

    def close(self) -> None:
        self._stop_worker()
        self.helper.close()

    # -- helpers -----------------------------------------------------------------------------------

    def _start_worker(self, drafter: Drafter, threads: tuple[int, int] | None) -> None:
        target = self.state.target
        if threads and target.threads is not None:
            target.threads.set_threads(threads[0])
        worker = DraftWorker(drafter, self.state.config, self.state.timeline, target.vocab_size,
                             threads[1] if threads else None,
                             # the draft's first choice is the drafted token itself: kappa alternatives after it
                             self.state.config.branch_width + 1 if self.branch_source == "draft" else 0, self.draft_core)
        if not worker.start():
            self.fallback = fallback_message(drafter, RuntimeError("still busy in a call from an earlier request"))
            self._restore_threads()
            return
        self.worker = worker
        if threads and target.threads is not None:
            self.sharing = CoreSharing(target.threads, lambda: worker.drafting, threads)
        # Where the first step prefills the target alone, K is chosen from costs measured after it: the worker
        # may draft for the largest K meanwhile (its core is otherwise idle through the longest pass).
        schedule = self.state.policy.schedule
        k = schedule.max_k if schedule.prefill_alone else schedule.k
        worker.draft_queue.put(Rebase(self.look.epoch, tuple(self.state.committed), (), self._limit(k), None))

    def _limit(self, k: int) -> int:
        """How far past the committed history the worker may draft: this step's K, the next step's K, and
        the bonus position between them."""
        return len(self.state.committed) + 2 * k + 1

    def _helper_draft(self, k: int) -> Draft | None:
        """The helper's draft, made now, if verifying it promises more tokens per second than
        waiting for the lookahead (expected tokens per step, Leviathan, over the step's time)."""
        if not (self.state.policy.may_serve_helper() and self.helper.active and self.verify_seconds.value):
            return None
        drain(self.worker, self.look, len(self.state.committed), None)
        wait_k = self._wait_k(k)
        if len(self.look.tokens) >= wait_k or self.look.stalled_at is not None:
            return None
        draft = self.helper.propose(self.state.committed, k)
        wait = (wait_k - len(self.look.tokens)) * (self.worker.token_seconds.value or 0.0)
        pays = self.state.policy.helper_pays(self.helper_acceptance.alpha, len(draft.tokens), wait_k, wait,
                                           self.verify_seconds.value)
        return draft if pays else None

    def _wait_k(self, k: int) -> int:
        """How many lookahead tokens this step waits for: the whole K; on a fresh lookahead (after a
        miss) the schedule's fresh_k; none at the request's first step where the schedule prefills the target
        alone. Seeded sampling's schedule does neither (reproducible drafts)."""
        schedule = self.state.policy.schedule
        if self.state.generated == 0 and schedule.prefill_alone:
            return 0
        return min(k, schedule.fresh_k) if self.fresh else k

    def _lookahead_draft(self, k: int) -> Draft:
        """Up to `k` lookahead tokens, waiting for the worker until it has sent `_wait_k(k)`; drops the
        worker on a fault."""
        reason = fill(self.worker, self.look, len(self.state.committed), self._wait_k(k),
                      self.state.config.draft_timeout_s)
        if reason is not None:
            self.fallback = fallback_message(self.worker.drafter, RuntimeError(reason))
            self._stop_worker()
            return Draft.empty()
        self.fresh = False
        k = min(k, len(self.look.tokens))
        return Draft(self.look.tokens[:k], self.look.q(k), self.worker.drafter.name) if k else Draft.empty()

    def _stop_worker(self) -> None:
        if self.sharing is not None:  # the target has the CPU to itself from now on
            self.sharing.close()
            self.sharing = None
        if self.worker is not None:
            self.worker.stop(wait=0.5)
            if self.worker.thread.is_alive():
                log.warning("draft worker still busy in %r; it will exit when that call returns", self.worker.drafter.name)
            self.worker = None
        self._restore_threads()

    def _restore_threads(self) -> None:
        if self.saved_threads is not None:
            self.state.target.threads.set_threads(self.saved_threads)
