"""The verify worker's view of the draft worker's lookahead, and reading the verify queue into it.

`Lookahead` holds the draft tokens (and q rows, and the draft's candidates when it ranks) received past
the committed history in the current epoch. `take` applies one message, `fill` waits until enough tokens
arrived (or the drafter stalled, failed or timed out), `drain` applies what is there without waiting and
collects this step's branches (`StepBranches`).
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

import numpy as np

from mirrorsd.contracts import BranchState
from mirrorsd.runtime.decode.pipeline.worker import (BranchChunk, BranchesPlanned, Chunk, DraftWorker, Extend, Ranks, Stalled,
                                            WorkerFailed)

Prepared = tuple[list[int], list, list]
"""A prepared branch's tokens, q rows (None each for one-hot drafts) and candidate rows (None each if unranked)."""


@dataclass
class StepBranches:
    """This step's branches as the draft worker reported them by reconcile time."""
    drafted: dict[tuple[int, int], Prepared] = field(default_factory=dict)  # by (at, correction)
    finished: set[tuple[int, int]] = field(default_factory=set)  # drafted to their planned length
    planned: tuple[tuple[int, int], ...] | None = None  # None: the worker's plan had not arrived

    def get(self, key: tuple[int, int]) -> Prepared | None:
        return self.drafted.get(key)

    def state(self, key: tuple[int, int]) -> BranchState:
        if key in self.finished:
            return "ready"
        if key in self.drafted:
            return "drafting"
        return "queued" if self.planned and key in self.planned else "none"

    @property
    def ready(self) -> int:
        return len(self.finished & set(self.planned or ()))


@dataclass
class Lookahead:
    """Draft tokens received past the committed history, in epoch `epoch`."""
    epoch: int = 0
    tokens: list[int] = field(default_factory=list)
    probs: list[np.ndarray | None] = field(default_factory=list)
    ranks: list[tuple[np.ndarray, np.ndarray] | None] = field(default_factory=list)  # the draft's candidates
    stalled_at: int | None = None  # absolute position where the drafter proposed nothing

    def q(self, k: int) -> np.ndarray | None:
        """[k, V] q rows of the first k tokens; None for one-hot drafts."""
        return np.stack(self.probs[:k]) if k and self.probs[0] is not None else None

    def candidates(self, k: int) -> Ranks | None:
        """The draft's candidates at the first min(k + 1, len) positions (row i: position i past committed),
        if every one of them has some; None otherwise."""
        rows = self.ranks[:k + 1]
        if not rows or any(r is None for r in rows):
            return None
        width = min(r[0].shape[0] for r in rows)
        return np.stack([r[0][:width] for r in rows]), np.stack([r[1][:width] for r in rows])

    def advance(self, n: int) -> None:
        """The first n tokens were committed."""
        del self.tokens[:n], self.probs[:n], self.ranks[:n]

    def rebase(self, ahead: Prepared | None) -> None:
        """A new epoch, holding `ahead` (a branch hit's tokens, q rows and candidates) or nothing."""
        self.epoch += 1
        self.tokens, self.probs, self.ranks = (list(ahead[0]), list(ahead[1]), list(ahead[2])) if ahead else ([], [], [])
        self.stalled_at = None


def _rows(msg) -> tuple[list, list]:
    """A chunk's q rows and candidate rows, one per token (None where it has none)."""
    n = len(msg.tokens)
    probs = list(msg.probs) if msg.probs is not None else [None] * n
    ranks = list(zip(msg.ranks[0], msg.ranks[1])) if msg.ranks is not None else [None] * n
    return probs, ranks


def take(msg, look: Lookahead, committed_len: int, step_base: int | None, branches: StepBranches) -> str | None:
    """Apply one verify-queue message; returns the worker's failure reason if it sent one."""
    if isinstance(msg, WorkerFailed):
        return msg.reason
    if isinstance(msg, Chunk) and msg.epoch == look.epoch and msg.pos == committed_len + len(look.tokens):
        probs, ranks = _rows(msg)
        look.tokens.extend(msg.tokens)
        look.probs.extend(probs)
        look.ranks.extend(ranks)
    elif isinstance(msg, Stalled) and msg.epoch == look.epoch:
        look.stalled_at = msg.pos
    elif isinstance(msg, BranchesPlanned) and msg.base_len == step_base:
        branches.planned = msg.keys
    elif isinstance(msg, BranchChunk) and msg.base_len == step_base:
        key = (msg.at, msg.correction)
        tokens, probs, ranks = branches.drafted.setdefault(key, ([], [], []))
        more_probs, more_ranks = _rows(msg)
        tokens.extend(msg.tokens)
        probs.extend(more_probs)
        ranks.extend(more_ranks)
        if msg.finished:
            branches.finished.add(key)
    return None


def fill(worker: DraftWorker, look: Lookahead, committed_len: int, wait_k: int, timeout: float) -> str | None:
    """Wait until the lookahead holds `wait_k` tokens or the drafter has stalled. Returns why the drafter
    must be dropped (failed, garbage, timed out, worker gone), or None."""
    deadline = time.perf_counter() + timeout
    if len(look.tokens) < wait_k:
        worker.draft_queue.put(Extend(committed_len + wait_k + 1))
    while len(look.tokens) < wait_k:
        if look.stalled_at is not None and look.stalled_at <= committed_len + len(look.tokens):
            return None
        left = deadline - time.perf_counter()
        if left <= 0:
            return f"no draft within {timeout:g} s"
        try:
            msg = worker.verify_queue.get(timeout=min(left, 0.05))
        except queue.Empty:
            if not worker.thread.is_alive() and worker.verify_queue.empty():
                return "the draft worker exited"
            continue
        reason = take(msg, look, committed_len, None, StepBranches())
        if reason:
            return reason
    return None


def drain(worker: DraftWorker, look: Lookahead, committed_len: int, step_base: int | None) -> StepBranches:
    """Everything the worker sent so far; returns this step's branches."""
    branches = StepBranches()
    while True:
        try:
            msg = worker.verify_queue.get_nowait()
        except queue.Empty:
            return branches
        if isinstance(msg, WorkerFailed):
            worker.verify_queue.put(msg)  # fill() reports it at the next step
            return branches
        take(msg, look, committed_len, step_base, branches)
