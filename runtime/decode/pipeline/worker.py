"""The pipeline's draft worker: a thread that owns the drafter, and the messages the two workers exchange.

    verify worker --draft queue-->  draft worker    Rebase / Advance / Extend / Hint / STOP
    verify worker <--verify queue-- draft worker    Chunk / Stalled / BranchesPlanned / BranchChunk / WorkerFailed

The worker keeps a *lookahead*: tokens drafted past the committed history on the assumption that every
step is fully accepted (its own guess at each bonus token included), up to `limit`. Given a Hint, it
also drafts the likeliest early-exit branches (branches.py). Epochs let each side drop stale messages.
With `rank_width` > 0 and a draft model that ranks, every drafted token carries the draft's top candidates at its
position (Chunk.ranks): the target can build a step's Hint from them (branch_source "draft").
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from mirrorsd.config import GenerationConfig
from mirrorsd.contracts import Draft, Drafter
from mirrorsd.runtime.decode.pipeline.branches import Branch, Hint, plan_branches
from mirrorsd.runtime.decode.policy.estimates import Ema
from mirrorsd.runtime.decode.drafting import check_draft
from mirrorsd.runtime.decode.pipeline.threads import draft_control, leave_signals_to_the_main_thread, pinned
from mirrorsd.runtime.timeline import DRAFT, Timeline

# -- messages: verify worker -> draft worker (the draft queue) -------------------------------------


@dataclass(frozen=True)
class Rebase:
    """The committed history left the lookahead: continue from committed + ahead."""
    epoch: int
    committed: tuple[int, ...]
    ahead: tuple[int, ...]  # draft tokens the target already holds past committed (a branch hit)
    limit: int  # draft up to this absolute sequence length
    n_accepted: int | None  # feedback for drafter.accepted(); None when the request starts


@dataclass(frozen=True)
class Advance:
    """The step was fully accepted onto the lookahead: keep drafting it."""
    committed_len: int
    limit: int
    n_accepted: int


@dataclass(frozen=True)
class Extend:
    """The target wants a longer draft than the current limit allows."""
    limit: int


STOP = "stop"


# -- messages: draft worker -> verify worker (the verify queue) ------------------------------------

Ranks = tuple[np.ndarray, np.ndarray]
"""([n, kappa] token ids, [n, kappa] log-probabilities): a drafter's top candidates at n positions."""


@dataclass(frozen=True)
class Chunk:
    epoch: int
    pos: int  # absolute position of tokens[0]
    tokens: tuple[int, ...]
    probs: np.ndarray | None  # [len(tokens), V] q rows, None for one-hot drafts
    ranks: Ranks | None = None  # the draft's top candidates at each token's position (rank_width > 0)


@dataclass(frozen=True)
class Stalled:
    epoch: int
    pos: int  # the drafter proposed nothing at this absolute position


@dataclass(frozen=True)
class BranchChunk:
    base_len: int  # the step the branch belongs to
    at: int  # hypothesis: draft tokens [0, at) accepted, the target then committed `correction`
    correction: int
    tokens: tuple[int, ...]  # next tokens of the branch, continuing those sent before
    probs: np.ndarray | None
    finished: bool = False  # the branch now holds all the tokens it was planned to get
    ranks: Ranks | None = None


@dataclass(frozen=True)
class BranchesPlanned:
    """The worker took in a step's Hint and planned these branches (best first)."""
    base_len: int
    keys: tuple[tuple[int, int], ...]  # (at, correction) per branch


@dataclass(frozen=True)
class WorkerFailed:
    reason: str


# -- the draft worker ------------------------------------------------------------------------------

_busy_lock = threading.Lock()
_busy_drafters: set[int] = set()  # id() of drafters a worker thread is still running (a hung call)


@dataclass
class _State:
    """What the draft worker knows: the committed history + its lookahead, and what it should draft."""
    seq: list[int] = field(default_factory=list)
    epoch: int = -1
    limit: int = 0
    stalled: bool = False
    branches: list[Branch] = field(default_factory=list)  # best first
    lookahead_score: float = 0.0  # early-exit estimate that the current step lands on the lookahead

    @property
    def wants_lookahead(self) -> bool:
        return not self.stalled and len(self.seq) < self.limit

    @property
    def idle(self) -> bool:
        return not self.branches and not self.wants_lookahead


class DraftWorker:
    """Owns the drafter on its own thread (see the module docstring for the protocol)."""

    def __init__(self, drafter: Drafter, config: GenerationConfig, timeline: Timeline, vocab_size: int,
                 threads: int | None = None, rank_width: int = 0, core: int | None = None) -> None:
        """threads: the draft model's CPU threads on this thread; core: run on this CPU core alone (a pinned
        CoreLayout)."""
        self.drafter, self.config, self.timeline = drafter, config, timeline
        self.vocab_size, self.threads, self.core = vocab_size, threads, core
        self.model = drafter.model  # drafts token by token where the drafter runs a model
        self.ranking = self.model.ranking if self.model is not None and rank_width else None
        self.rank_width = rank_width if self.ranking is not None else 0
        self.draft_queue: queue.Queue = queue.Queue()
        self.verify_queue: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()
        self.drafting = False  # False while the worker waits for instructions (its cores are free)
        self.token_seconds = Ema(0.8)  # seconds to draft one token (the only owner of this estimate)
        self._prefilled = False  # the first draft call also prefills the prompt: not a token's cost
        self.thread = threading.Thread(target=self._run, name="mirrorsd-draft", daemon=True)

    def start(self) -> bool:
        """Start the thread, unless a worker of an earlier request is still inside this drafter."""
        with _busy_lock:
            if id(self.drafter) in _busy_drafters:
                return False
            _busy_drafters.add(id(self.drafter))
        self.thread.start()
        return True

    def stop(self, wait: float = 5.0) -> None:
        """Ask the worker to finish and wait up to `wait` seconds (a hung drafter may outlive this)."""
        self.cancelled.set()
        self.draft_queue.put(STOP)
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(wait)

    def _run(self) -> None:
        leave_signals_to_the_main_thread()
        try:
            if self.threads and self.model is not None and self.model.lm.threads is not None:
                self.model.lm.threads.set_threads(self.threads)  # this thread's; the target keeps its own
            with pinned(self.core, draft_control(self.drafter)):
                self.drafter.start(self.config)
                state = _State()
                while not self.cancelled.is_set():
                    if not self._receive(state):
                        return
                    self._work(state)
        except BaseException as exc:  # noqa: BLE001 - whatever kills the worker must reach the target
            self.verify_queue.put(WorkerFailed(f"{type(exc).__name__}: {exc}"))
        finally:
            self.drafting = False
            with _busy_lock:
                _busy_drafters.discard(id(self.drafter))

    def _receive(self, state: _State) -> bool:
        """Apply every pending message (waiting for one while idle); False on STOP or cancellation."""
        if state.idle:
            self.drafting = False
        try:
            msg = self.draft_queue.get(block=state.idle)
        except queue.Empty:
            msg = None
        while msg is not None:
            if msg == STOP:
                return False
            self._apply(msg, state)
            try:
                msg = self.draft_queue.get_nowait()
            except queue.Empty:
                msg = None
        return not self.cancelled.is_set()

    def _apply(self, msg, state: _State) -> None:
        if isinstance(msg, Rebase):
            if msg.n_accepted is not None:
                self.drafter.accepted(msg.committed, msg.n_accepted)
            state.seq = list(msg.committed) + list(msg.ahead)
            state.epoch, state.limit, state.stalled, state.branches = msg.epoch, msg.limit, False, []
        elif isinstance(msg, Advance):
            self.drafter.accepted(tuple(state.seq[:msg.committed_len]), msg.n_accepted)
            state.limit, state.branches = msg.limit, []
        elif isinstance(msg, Extend):
            state.limit = max(state.limit, msg.limit)
        elif isinstance(msg, Hint):
            plan = plan_branches(msg, state.seq, self.token_seconds.value, time.perf_counter())
            state.branches, state.lookahead_score = plan.branches, plan.lookahead_score
            self.verify_queue.put(BranchesPlanned(msg.base_len, tuple((b.at, b.correction) for b in plan.branches)))

    def _work(self, state: _State) -> None:
        """One unit of drafting: the best branch while it beats the lookahead, else the lookahead."""
        self.drafting = not state.idle
        if state.branches and (not state.wants_lookahead or state.branches[0].score > state.lookahead_score):
            self._draft_branch(state.branches)
        elif state.wants_lookahead:
            tokens, probs, ranks = self._draft(state.seq, state.limit - len(state.seq), "lookahead")
            if tokens:
                self.verify_queue.put(Chunk(state.epoch, len(state.seq), tuple(tokens), probs, ranks))
                state.seq.extend(tokens)
            else:
                state.stalled = True
                self.verify_queue.put(Stalled(state.epoch, len(state.seq)))

    def _draft(self, context: list[int], k: int,
               what: str) -> tuple[list[int], np.ndarray | None, Ranks | None]:
        """A single token from a draft model (so the worker can react to new messages between tokens),
        or a whole proposal from a model-free drafter; with the draft's top candidates when ranking."""
        ranks = None
        with self.timeline.span(DRAFT, what) as span:
            start = time.perf_counter()
            if self.ranking is not None:
                ranked = list(self.ranking.propose_ranked(tuple(context), 1, self.rank_width))
                pairs = [(t, q) for t, q, _, _ in ranked]
                ranks = _checked_ranks(ranked, self.rank_width, self.vocab_size)
            elif self.model is not None:
                pairs = list(self.model.propose_iter(tuple(context), 1))
            if self.model is not None:
                rows = [q for _, q in pairs if q is not None]
                draft = Draft([t for t, _ in pairs], np.stack(rows) if rows else None, self.drafter.name)
                draft = check_draft(draft, min(k, 1), self.vocab_size)
            else:  # the drafter sees a tuple: it cannot write to the worker's history
                draft = check_draft(self.drafter.propose(tuple(context), k), k, self.vocab_size)
            span["tokens"] = len(draft.tokens)
        if draft.tokens and self._prefilled:
            self.token_seconds.update((time.perf_counter() - start) / len(draft.tokens))
        self._prefilled = self._prefilled or bool(draft.tokens)
        return list(draft.tokens), draft.probs, ranks

    def _draft_branch(self, branches: list[Branch]) -> None:
        branch = branches[0]
        tokens, probs, ranks = self._draft(branch.context, branch.left, f"branch {branch.at}:{branch.correction}")
        if tokens:
            branch.context.extend(tokens)
            branch.left -= len(tokens)
            self.verify_queue.put(BranchChunk(branch.base_len, branch.at, branch.correction, tuple(tokens), probs,
                                              branch.left <= 0, ranks))
        if not tokens or branch.left <= 0:
            branches.pop(0)


def _checked_ranks(ranked: list, kappa: int, vocab_size: int) -> Ranks | None:
    """The candidates of propose_ranked's tokens as Ranks, or None unless each token has 1..kappa ids in the
    target vocabulary with log-probabilities (<= 0, no NaN): they are hints, so bad ones are ignored."""
    if not ranked:
        return None
    try:
        ids = np.stack([np.asarray(r[2]) for r in ranked]).astype(np.int64)
        logp = np.stack([np.asarray(r[3], dtype=np.float64) for r in ranked])
    except (TypeError, ValueError):
        return None
    if ids.ndim != 2 or ids.shape[0] != len(ranked) or ids.shape[1] > kappa or logp.shape != ids.shape or ids.min() < 0 or ids.max() >= vocab_size:
        return None
    if ids.size == 0 or np.isnan(logp).any() or (logp > 1e-6).any():
        return None
    return ids, logp
