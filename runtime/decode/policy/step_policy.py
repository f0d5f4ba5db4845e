"""Every adaptive choice of one request, in one place: the StepPolicy.

Per step it decides how many tokens to draft (the K schedule, schedule.py) and whether to draft at all (the
speculation gate, gate.py, which the schedule's cost model may pause); how much of a model-free draft to verify,
from the acceptance of its match class (`fit`); overlapped, whether the helper's
draft serves instead of waiting for the worker's lookahead, and whether a step asks for
early-exit branch candidates. Seeded sampling with a model's drafts (`schedule.timing_free`) must not let timing
steer any of these: read here, once. Output never depends on a choice made here, only speed.
"""

from __future__ import annotations

from mirrorsd.config import GenerationConfig
from mirrorsd.contracts import Draft
from mirrorsd.runtime.decode.policy.gate import SpeculationGate
from mirrorsd.runtime.decode.policy.match_classes import MatchClasses
from mirrorsd.runtime.decode.policy.schedule import make_schedule, timing_free
from mirrorsd.runtime.decode.policy.speedup import expected_tokens_per_step

MIN_MISS_FOR_BRANCHES = 0.5
"""Early exit is requested only for steps predicted to leave the lookahead at least this often
(1 - alpha^(k+1)): the LM head at l_e and the branch drafting cost time that a step landing on the
lookahead does not repay (docs/measurements.md)."""

MAX_DRAFT_ALPHA = 0.95
"""With the draft's candidates, branches are ranked with the running acceptance estimate as the chance to
pass each position; capped so that a run of accepted steps does not rule rejections out."""


class StepPolicy:
    def __init__(self, config: GenerationConfig, overlapped: bool = False,
                 curve: tuple[float, ...] | None = None, matches: MatchClasses | None = None,
                 model_drafts: bool = True) -> None:
        """model_drafts: the request's drafts may carry a model's distribution (False: a model-free drafter)."""
        self.timing_free = timing_free(config, model_drafts)
        self.schedule = make_schedule(config, overlapped, curve, model_drafts)
        self.gate = SpeculationGate(enabled=not self.timing_free)
        self.matches = matches or MatchClasses()  # the target's, learned across requests
        self._proposed: Draft | None = None  # this step's model-free draft as proposed, before fit cut it
        self._asked = False  # this step asked the drafter for a draft (the gate let it)

    @property
    def alpha(self) -> float:
        """The running per-token acceptance estimate of the model drafter."""
        return self.schedule.acceptance.alpha

    def draft_length(self, room: int) -> int:
        """Tokens to draft this step, at most `room` (0: a plain step: no room, or the gate has drafting paused)."""
        k = min(self.schedule.k, room)
        self._asked = k > 0 and self.gate.should_draft()
        return k if self._asked else 0

    def fit(self, draft: Draft, whole: bool = False) -> Draft:
        """This step's draft as it will be verified: a model-free draft cut to the length that pays at its match
        class's acceptance (match_classes.py; none left: a plain step), the class learning from the step.
        whole: verified as it is (a draft weighed against something else than a plain step). A model's draft,
        and every draft where timing must not steer a choice (seeded sampling, fixed K), is returned as it is."""
        cost = self._class_cost(draft)
        self._proposed = None if cost is None else draft
        return draft if whole or cost is None else self.matches.fit(draft, cost)

    def _class_cost(self, draft: Draft) -> list[float] | None:
        """The verify costs a model-free draft is cut against (None: not cut)."""
        if not draft.match or not draft.tokens or self.timing_free:
            return None
        return self.schedule.verify_costs(len(draft.tokens))

    def learn(self, n_drafted: int, n_accepted: int, committed: list[int], draft_seconds: float,
              verify_seconds: float, step_seconds: float, measured: bool, schedule: bool = True) -> None:
        """A step's outcome (n_drafted tokens verified, `committed` the tokens it committed). measured=False: the
        step carried the prompt prefill (its time says nothing about drafting). schedule=False: another drafter
        than the one the K schedule describes served it."""
        if self._proposed is not None:
            self.matches.learn(self._proposed, n_drafted, n_accepted, committed)
            self._proposed = None
        if schedule:
            if measured:
                self.schedule.observe(n_drafted, draft_seconds, verify_seconds)
            self.schedule.update(n_drafted, n_accepted)
        # The gate weighs the steps that asked for a draft, whatever was verified: a draft that its match class
        # cut to nothing, or an empty one, still cost its drafting.
        asked, self._asked = self._asked or n_drafted > 0, False
        if measured:
            self.gate.record(asked, len(committed), step_seconds)
            if schedule and n_drafted > 0 and self.schedule.pays() is False:
                self.gate.pause()  # the cost model sees a loss at every K before the rates do

    def may_serve_helper(self) -> bool:
        """Whether the model-free helper may serve a step in place of the worker's lookahead (a choice
        made from timing)."""
        return not self.timing_free

    def helper_pays(self, helper_alpha: float, helper_k: int, wait_k: int, wait_s: float, verify_s: float) -> bool:
        """The helper's draft (`helper_k` tokens at acceptance `helper_alpha`, verified at once) promises more
        tokens per second than waiting `wait_s` for `wait_k` lookahead tokens (expected tokens per step,
        Leviathan, over the step's time)."""
        model_rate = expected_tokens_per_step(self.alpha, wait_k) / (wait_s + verify_s)
        return expected_tokens_per_step(helper_alpha, helper_k) / verify_s > model_rate

    def wants_branches(self, k: int) -> bool:
        """A step of k drafted tokens is likely enough to leave the lookahead to pay for branch candidates."""
        return 1.0 - self.alpha ** (k + 1) >= MIN_MISS_FOR_BRANCHES

    def branch_alpha(self) -> float:
        """The chance to pass each position that ranks the draft's candidate branches."""
        return min(self.alpha, MAX_DRAFT_ALPHA)
