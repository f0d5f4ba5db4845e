"""The verify worker's view of the draft worker's lookahead, and reading the verify queue into it.

`Lookahead` holds the draft tokens (and q rows) received past the committed history in the current
epoch. `take` applies one message, `fill` waits until enough tokens arrived (or the drafter stalled,
failed or timed out), `drain` applies what is there without waiting and collects this step's branches.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

import numpy as np

from mirrorsd.runtime.decode.worker import BranchChunk, Chunk, DraftWorker, Extend, Stalled, WorkerFailed

Branches = dict[tuple[int, int], tuple[list[int], list]]
"""This step's prepared branches by (at, correction): (tokens, q rows)."""


@dataclass
class Lookahead:
    """Draft tokens received past the committed history, in epoch `epoch`."""
    epoch: int = 0
    tokens: list[int] = field(default_factory=list)
    probs: list[np.ndarray | None] = field(default_factory=list)
    stalled_at: int | None = None  # absolute position where the drafter proposed nothing

    def q(self, k: int) -> np.ndarray | None:
        """[k, V] q rows of the first k tokens; None for one-hot drafts."""
        return np.stack(self.probs[:k]) if k and self.probs[0] is not None else None

    def advance(self, n: int) -> None:
        """The first n tokens were committed."""
        del self.tokens[:n], self.probs[:n]

    def rebase(self, ahead: tuple[list[int], list] | None) -> None:
        """A new epoch, holding `ahead` (a branch hit's tokens and q rows) or nothing."""
        self.epoch += 1
        self.tokens, self.probs = (list(ahead[0]), list(ahead[1])) if ahead else ([], [])
        self.stalled_at = None


def take(msg, look: Lookahead, committed_len: int, step_base: int | None, branches: Branches) -> str | None:
    """Apply one verify-queue message; returns the worker's failure reason if it sent one."""
    if isinstance(msg, WorkerFailed):
        return msg.reason
    if isinstance(msg, Chunk) and msg.epoch == look.epoch and msg.pos == committed_len + len(look.tokens):
        look.tokens.extend(msg.tokens)
        look.probs.extend(msg.probs if msg.probs is not None else [None] * len(msg.tokens))
    elif isinstance(msg, Stalled) and msg.epoch == look.epoch:
        look.stalled_at = msg.pos
    elif isinstance(msg, BranchChunk) and msg.base_len == step_base:
        tokens, probs = branches.setdefault((msg.at, msg.correction), ([], []))
        tokens.extend(msg.tokens)
        probs.extend(msg.probs if msg.probs is not None else [None] * len(msg.tokens))
    return None


def fill(worker: DraftWorker, look: Lookahead, committed_len: int, want: int, timeout: float) -> str | None:
    """Wait until the lookahead holds `want` tokens or the drafter has stalled. Returns why the drafter
    must be dropped (failed, garbage, timed out, worker gone), or None."""
    deadline = time.perf_counter() + timeout
    if len(look.tokens) < want:
        worker.draft_queue.put(Extend(committed_len + want + 1))
    while len(look.tokens) < want:
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
        reason = take(msg, look, committed_len, None, {})
        if reason:
            return reason
    return None


def drain(worker: DraftWorker, look: Lookahead, committed_len: int, step_base: int | None) -> Branches:
    """Everything the worker sent so far; returns this step's branches."""
    branches: Branches = {}
    while True:
        try:
            msg = worker.verify_queue.get_nowait()
        except queue.Empty:
            return branches
        if isinstance(msg, WorkerFailed):
            worker.verify_queue.put(msg)  # fill() reports it at the next step
            return branches
        take(msg, look, committed_len, step_base, branches)
