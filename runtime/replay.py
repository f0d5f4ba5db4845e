"""Offline acceptance: how a drafter would fare against outputs the target already produced.

Greedy speculative decoding commits exactly the target's greedy output, so a drafter's acceptance on it
can be measured without running the target again: replay the output step by step, ask the drafter for
up to K tokens at each point, accept the matching prefix, advance by accepted + 1. Used by
`mirrorsd eval-drafts`, `mirrorsd draft-bench` and export validation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from mirrorsd.config import GenerationConfig
from mirrorsd.contracts import Drafter

BUCKET = 16  # tokens per bucket of alpha-by-sequence-position


@dataclass
class AcceptanceCounts:
    """Offline acceptance of one drafter against target outputs (accumulates over prompts)."""

    steps: int = 0
    steps_drafted: int = 0
    committed: int = 0
    drafted: int = 0
    accepted: int = 0
    trials: int = 0  # draft positions reached (every earlier one accepted): the denominator of alpha
    propose_s: float = 0.0
    pos_trials: list[int] = field(default_factory=list)  # per draft position
    pos_accepted: list[int] = field(default_factory=list)
    seq_trials: dict[int, int] = field(default_factory=dict)  # per bucket of generated position
    seq_accepted: dict[int, int] = field(default_factory=dict)

    @property
    def alpha(self) -> float | None:
        """Per-token acceptance: accepted / draft positions reached (Leviathan's alpha)."""
        return self.accepted / self.trials if self.trials else None

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens (as GenerationStats reports it)."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Committed tokens per step, the target's own token included."""
        return self.committed / self.steps if self.steps else None

    def record(self, at: int, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.steps_drafted += drafted > 0
        self.committed += accepted + 1
        self.drafted += drafted
        self.accepted += accepted
        reached = min(accepted + 1, drafted)
        self.trials += reached
        for j in range(reached):
            if j >= len(self.pos_trials):
                self.pos_trials.append(0)
                self.pos_accepted.append(0)
            self.pos_trials[j] += 1
            self.pos_accepted[j] += j < accepted
            b = (at + j) // BUCKET
            self.seq_trials[b] = self.seq_trials.get(b, 0) + 1
            self.seq_accepted[b] = self.seq_accepted.get(b, 0) + (j < accepted)


def replay_acceptance(drafter: Drafter, prompt_ids: list[int], target_tokens: list[int], k: int,
                       counts: AcceptanceCounts | None = None) -> AcceptanceCounts:
    """Replay `target_tokens` (the target's greedy output after `prompt_ids`) as greedy speculative
    decoding with `drafter` at up to k tokens per step would commit it (propose, accept the matching
    prefix, advance by accepted + 1), counting acceptance into `counts`."""
    counts = counts or AcceptanceCounts()
    drafter.start(GenerationConfig(max_new_tokens=max(1, len(target_tokens)), num_draft_tokens=max(1, k)))
    pos = 0
    while pos < len(target_tokens):
        committed = list(prompt_ids) + target_tokens[:pos]
        budget = min(k, len(target_tokens) - pos - 1)
        tokens: list[int] = []
        if budget > 0:
            t0 = time.perf_counter()
            tokens = list(drafter.propose(committed, budget).tokens)[:budget]
            counts.propose_s += time.perf_counter() - t0
        n = 0
        while n < len(tokens) and tokens[n] == target_tokens[pos + n]:
            n += 1
        counts.record(pos, len(tokens), n)
        pos += n + 1
        drafter.accepted(list(prompt_ids) + target_tokens[:pos], n)
    return counts


def greedy_continuation(lm, prompt_ids: list[int], n: int) -> list[int]:
    """The n tokens a CausalLM decodes greedily after prompt_ids, one at a time: what replay checks against."""
    context = list(prompt_ids)
    for _ in range(min(n, lm.max_context - len(context))):
        context.append(int(lm.score(context)[-1].argmax()))
    return context[len(prompt_ids):]
