"""The Mirror-SD two-queue pipeline: drafting overlaps verification.

Two workers, each owning its device: the **draft worker** (a thread that owns the drafter) and the
**verify worker** (the thread iterating `pipelined_decode`, which owns the target). They talk through
two queues and pass only token ids, a few top-k log-probs and draft distributions:

    verify worker --draft queue-->  draft worker    Rebase / Advance / Extend / Hint / STOP
    verify worker <--verify queue-- draft worker    Chunk / Stalled / BranchChunk / WorkerFailed

The draft worker keeps a *lookahead*: tokens drafted past the committed history on the assumption
that every step is fully accepted (its own guess at each bonus token included). While the target
verifies step t (the first K lookahead tokens), the worker is already drafting step t+1.

With early exit (Mirror-SD), the verify pass publishes the top-kappa tokens of every position at layer
l_e, halfway through the pass. The worker then drafts short continuations of the likeliest
(rejection point, correction) *branches* within the time the pass has left.

After each step the verifier reconciles. If the committed history is still a prefix of the lookahead,
the rest of the lookahead is the next draft (Advance). If the outcome landed on a prepared branch, that
branch is the next draft (Rebase with it). Otherwise everything drafted past the divergence is stale and
the worker starts again from the committed history (Rebase). Epochs let each side drop stale messages.

Lossless: only `verify` commits tokens, exactly as in the sequential loop. Drafts made ahead of time
are conditioned on the same context as drafts made afresh; which ones get used depends only on that
context and the target's own randomness. A seeded run therefore reproduces the sequential loop token
for token (see TorchDraftModel's context-keyed random stream).

Faults: a drafter that raises, returns garbage, or does not answer within draft_timeout_s is dropped
for the rest of the request and the `fallback` drafter (model-free, run inline) takes over. The worker
is told to stop; a hung drafter's thread ends when its call returns.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mirrorsd.config import GenerationConfig
from mirrorsd.contracts import Draft, Drafter
from mirrorsd.runtime.decode.schedule import AcceptanceEstimate, SpeculationGate, make_schedule
from mirrorsd.runtime.decode.sequential import Step, _check_draft, _drop
from mirrorsd.runtime.decode.speedup import expected_tokens_per_step
from mirrorsd.runtime.timeline import DRAFT, VERIFY, Timeline
from mirrorsd.runtime.backends.torch_lm import TorchCausalLM
from mirrorsd.verify import verify

log = logging.getLogger("mirrorsd")

MIN_BRANCH_SCORE = 0.02  # branches less likely than this (by early-exit estimate) are not drafted
MIN_MISS_FOR_BRANCHES = 0.5
"""Early exit is requested only for steps predicted to leave the lookahead at least this often
(1 - alpha^(k+1)): the LM head at l_e and the branch drafting cost time that a step landing on the
lookahead does not repay (measured: with every draft accepted, branches ran 20% slower than overlap)."""


# -- messages: verify worker -> draft worker (the draft queue) -------------------------------------

@dataclass(frozen=True)
class Rebase:
    """The committed history left the lookahead: continue from committed + ahead."""
    epoch: int
    committed: tuple[int, ...]
    ahead: tuple[int, ...]  # draft tokens the verifier already holds past committed (a branch hit)
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
    """The verifier wants a longer draft than the current limit allows."""
    limit: int


@dataclass(frozen=True)
class Hint:
    """Early-exit candidates of the step being verified."""
    base_len: int  # committed length when the step began
    draft: tuple[int, ...]  # the k tokens under verification
    top_ids: np.ndarray  # [k+1, kappa] top tokens at layer l_e, row i predicts position base_len + i
    top_logp: np.ndarray  # [k+1, kappa] their log-probabilities
    deadline: float  # perf_counter() time the verify pass is expected to end
    max_tokens: int  # draft at most this many tokens per branch


STOP = "stop"


# -- messages: draft worker -> verify worker (the verify queue) ------------------------------------

@dataclass(frozen=True)
class Chunk:
    epoch: int
    pos: int  # absolute position of tokens[0]
    tokens: tuple[int, ...]
    probs: np.ndarray | None  # [len(tokens), V] q rows, None for one-hot drafts
    seconds: float  # drafting time these tokens took


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


@dataclass(frozen=True)
class WorkerFailed:
    reason: str


# -- the draft worker ------------------------------------------------------------------------------

_busy_lock = threading.Lock()
_busy_drafters: set[int] = set()  # id() of drafters a worker thread is still running (a hung call)


class DraftWorker:
    """Owns the drafter on its own thread; see the module docstring for the protocol."""

    def __init__(self, drafter: Drafter, config: GenerationConfig, timeline: Timeline, vocab_size: int,
                 threads: int | None = None) -> None:
        self.drafter, self.config, self.timeline = drafter, config, timeline
        self.vocab_size, self.threads = vocab_size, threads
        self.draft_queue: queue.Queue = queue.Queue()
        self.verify_queue: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()
        self.drafting = False  # False while the worker waits for instructions (its cores are free)
        self.token_seconds: float | None = None  # moving average of the time to draft one token
        self.lookahead_score = 0.0  # early-exit estimate that the current step lands on the lookahead
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
        try:
            if self.threads:
                torch.set_num_threads(self.threads)  # per thread (OpenMP): the verifier keeps its own
            self.drafter.start(self.config)
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - whatever kills the worker must reach the verifier
            self.verify_queue.put(WorkerFailed(f"{type(exc).__name__}: {exc}"))
        finally:
            self.drafting = False
            with _busy_lock:
                _busy_drafters.discard(id(self.drafter))

    def _loop(self) -> None:
        seq: list[int] = []  # committed history + lookahead, as this worker knows it
        epoch, limit, stalled, committed_len = -1, 0, False, 0
        branches: list[list] = []  # [score, context, at, correction, tokens left, base_len], best first
        while not self.cancelled.is_set():
            idle = not branches and (stalled or len(seq) >= limit)
            if idle:
                self.drafting = False
            try:
                msg = self.draft_queue.get(block=idle)
            except queue.Empty:
                msg = None
            while msg is not None:
                if msg == STOP:
                    return
                if isinstance(msg, Rebase):
                    if msg.n_accepted is not None:
                        self.drafter.accepted(msg.committed, msg.n_accepted)
                    seq = list(msg.committed) + list(msg.ahead)
                    epoch, limit, stalled, committed_len, branches = msg.epoch, msg.limit, False, len(msg.committed), []
                elif isinstance(msg, Advance):
                    self.drafter.accepted(seq[:msg.committed_len], msg.n_accepted)
                    limit, committed_len, branches = msg.limit, msg.committed_len, []
                elif isinstance(msg, Extend):
                    limit = max(limit, msg.limit)
                elif isinstance(msg, Hint):
                    branches = self._plan_branches(msg, seq)
                try:
                    msg = self.draft_queue.get_nowait()
                except queue.Empty:
                    msg = None
            if self.cancelled.is_set():
                return
            self.drafting = bool(branches) or (not stalled and len(seq) < limit)
            if branches and (stalled or len(seq) >= limit or branches[0][0] > self.lookahead_score):
                self._draft_branch(branches)
            elif not stalled and len(seq) < limit:
                tokens, probs, seconds = self._draft(seq, limit - len(seq), "lookahead")
                if tokens:
                    self.verify_queue.put(Chunk(epoch, len(seq), tuple(tokens), probs, seconds))
                    seq.extend(tokens)
                else:
                    stalled = True
                    self.verify_queue.put(Stalled(epoch, len(seq)))

    def _draft(self, context: list[int], max_tokens: int, what: str) -> tuple[list[int], np.ndarray | None, float]:
        """One unit of drafting: a single token from drafters that draft token by token (so the worker
        can react to new messages between tokens), or a whole proposal from the others."""
        with self.timeline.span(DRAFT, what) as args:
            start = time.perf_counter()
            iterate = getattr(self.drafter, "propose_iter", None)
            if iterate is not None:
                pairs = list(iterate(context, 1))
                tokens = [t for t, _ in pairs]
                rows = [q for _, q in pairs if q is not None]
                draft = Draft(tokens, np.stack(rows) if rows else None, self.drafter.name)
            else:
                draft = self.drafter.propose(context, max_tokens)
            _check_draft(draft, min(max_tokens, 1) if iterate else max_tokens, self.vocab_size)
            seconds = time.perf_counter() - start
            args["tokens"] = len(draft.tokens)
        if draft.tokens:
            per_token = seconds / len(draft.tokens)
            self.token_seconds = per_token if self.token_seconds is None else 0.8 * self.token_seconds + 0.2 * per_token
        return list(draft.tokens), draft.probs, seconds

    def _plan_branches(self, hint: Hint, seq: list[int]) -> list[list]:
        """Rank (rejection point, correction) branches by their early-exit probability and keep those
        the remaining verify time can pay for.

        With p~ the layer-l_e distribution: the step reaches position i with probability
        prod_{j<i} p~_j(draft_j); it then commits x != draft_i with probability p~_i(x). Position k
        (all accepted) is a branch too, for bonus tokens other than the lookahead's own guess."""
        k, base = len(hint.draft), hint.base_len
        reach, candidates = 1.0, []
        lookahead_bonus = seq[base + k] if len(seq) > base + k and seq[base:base + k] == list(hint.draft) else None
        self.lookahead_score = 0.0
        for i in range(k + 1):
            ids, probs = hint.top_ids[i].tolist(), np.exp(hint.top_logp[i])
            own = hint.draft[i] if i < k else lookahead_bonus
            for x, p in zip(ids, probs):
                if x == own:
                    continue
                candidates.append([reach * float(p), list(seq[:base]) + list(hint.draft[:i]) + [x], i, x, 0, base])
            if i == k and own is not None:
                self.lookahead_score = reach * float(probs[ids.index(own)]) if own in ids else 0.0
            if i < k:
                reach *= float(probs[ids.index(own)]) if own in ids else 0.0
        candidates = sorted((c for c in candidates if c[0] >= MIN_BRANCH_SCORE), key=lambda c: -c[0])
        seconds_left = hint.deadline - time.perf_counter()
        budget = int(seconds_left / self.token_seconds) if self.token_seconds else 0
        chosen = candidates[: max(0, min(len(candidates), budget))]
        for c in chosen:
            c[4] = max(1, min(hint.max_tokens, budget // len(chosen)))
        return chosen

    def _draft_branch(self, branches: list[list]) -> None:
        score, context, at, correction, left, base = branches[0]
        tokens, probs, _ = self._draft(context, left, f"branch {at}:{correction}")
        if tokens:
            self.verify_queue.put(BranchChunk(base, at, correction, tuple(tokens), probs))
            context.extend(tokens)
            branches[0][4] -= len(tokens)
        if not tokens or branches[0][4] <= 0:
            branches.pop(0)


# -- the verify worker -----------------------------------------------------------------------------

class CoreSharing:
    """A work-conserving split of the CPU between the two workers when both compute on it: the verify
    pass runs on its own `verify` threads while the draft worker drafts, and takes the draft's threads
    too whenever the worker is idle (its lookahead is full), switching between decoder layers. A verify
    pass is most of a step and, with oneDNN kernels, runs far faster on every core; drafting K tokens
    is the short part, so a fixed split would leave the draft's core idle for the rest of the pass."""

    def __init__(self, model: torch.nn.Module, worker: "DraftWorker", threads: tuple[int, int]) -> None:
        self.worker, self.threads = worker, threads
        self.owner = threading.get_ident()  # only the verify worker's passes switch (a self-draft shares the model)
        self.current = torch.get_num_threads()
        layers = max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), key=len, default=[])
        self.handles = [layer.register_forward_pre_hook(self._before_layer) for layer in layers]

    def _before_layer(self, module, args) -> None:
        if threading.get_ident() != self.owner:
            return
        want = self.threads[0] + (0 if self.worker.drafting else self.threads[1])
        if want != self.current:
            torch.set_num_threads(want)
            self.current = want

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


@dataclass
class _Lookahead:
    """What the verify worker holds of the draft worker's lookahead, relative to `committed`."""
    tokens: list[int]
    probs: list[np.ndarray | None]
    stalled_at: int | None = None  # absolute position where the drafter proposed nothing
    token_seconds: float = 0.0


def pipelined_decode(
    verifier: TorchCausalLM,
    drafter: Drafter | None,
    prompt_ids: Sequence[int],
    config: GenerationConfig,
    max_new_tokens: int,
    *,
    branches: bool = True,
    fallback: Drafter | None = None,
    timeline: Timeline | None = None,
    threads: tuple[int, int] | None = None,
) -> Iterator[Step]:
    """Like speculative_decode (same Steps, same output), with drafting on a second worker.

    branches: use Mirror-SD early-exit branches when the target supports them.
    fallback: a cheap drafter run inline once the pipelined one is dropped (e.g. n-gram).
    threads: (verify, draft) torch CPU threads per worker when both share the CPU.
    """
    timeline = timeline or Timeline()
    rng = np.random.default_rng(config.seed)
    committed = list(prompt_ids)
    schedule = make_schedule(config, overlapped=True)
    gate = SpeculationGate(enabled=config.greedy or config.seed is None)
    acceptance = AcceptanceEstimate()
    early_exit = branches and getattr(verifier, "supports_early_exit", False) and config.branch_width > 0
    exit_layer = (config.early_exit_layer or max(1, verifier.num_layers // 2)) if early_exit else 0
    saved_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads[0])
    worker, reason, sharing = None, None, None
    if drafter is not None:
        worker = DraftWorker(drafter, config, timeline, verifier.vocab_size, threads[1] if threads else None)
        if not worker.start():
            reason = _drop(drafter, RuntimeError("still busy in a call from an earlier request"))
            worker = None
    if worker is not None and threads:
        sharing = CoreSharing(verifier.model, worker, threads)
    # The model-free drafter may serve any step, not only after the model drafter is dropped; where the
    # choice would depend on timing, a seeded sampling run keeps to the model (it must reproduce).
    choose = config.greedy or config.seed is None
    quick_acceptance = AcceptanceEstimate()  # the model-free drafter's, on the steps it served
    if fallback is not None:
        fallback.start(config)
    epoch = 0
    look = _Lookahead([], [])
    verify_seconds: float | None = None
    if worker:
        worker.draft_queue.put(Rebase(epoch, tuple(committed), (), len(committed) + 2 * schedule.k + 1, None))
    generated = 0
    try:
        while generated < max_new_tokens:
            budget = min(schedule.k, max_new_tokens - generated - 1, verifier.max_context - len(committed) - 1)
            t0 = time.perf_counter()
            draft, source, quick = Draft.empty(), "none", False
            if budget > 0 and gate.should_draft():
                if worker is not None and choose and fallback is not None and verify_seconds:
                    # Per step, the best available draft: the model-free one, made now, when verifying it
                    # promises more tokens per second than waiting for the worker's lookahead to fill.
                    _drain(worker, look, epoch, len(committed), None)
                    if len(look.tokens) < budget and look.stalled_at is None:
                        draft, reason = _propose_inline(fallback, committed, budget, verifier.vocab_size, timeline)
                        if reason:
                            fallback = None
                        quick = bool(draft.tokens) and _quick_pays(
                            len(draft.tokens), quick_acceptance.alpha, budget, acceptance.alpha,
                            (budget - len(look.tokens)) * look.token_seconds, verify_seconds)
                        if not quick:
                            draft = Draft.empty()
                if worker is not None and not quick:
                    reason = _fill(worker, look, epoch, len(committed), budget, config.draft_timeout_s)
                    if reason is None:
                        k = min(budget, len(look.tokens))
                        rows = look.probs[:k]
                        draft = Draft(look.tokens[:k], np.stack(rows) if k and rows[0] is not None else None,
                                      drafter.name)
                    else:  # the drafter failed: stop its worker, the fallback serves from now on
                        _stop_worker(worker)
                        worker = None
                        if sharing is not None:  # the verifier has the CPU to itself from now on
                            sharing.close()
                            sharing = None
                            torch.set_num_threads(saved_threads)
                if worker is None and fallback is not None:
                    draft, failed = _propose_inline(fallback, committed, budget, verifier.vocab_size, timeline)
                    if failed:
                        reason, fallback = failed, None
            if draft.tokens:
                source = draft.source
            t1 = time.perf_counter()
            hints: list[tuple[np.ndarray, np.ndarray]] = []
            exit_spec = None
            miss = 1.0 - acceptance.alpha ** (len(draft.tokens) + 1)
            if worker is not None and exit_layer and draft.tokens and not quick and miss >= MIN_MISS_FOR_BRANCHES:
                deadline = t1 + (verify_seconds or 0.0)
                kappa = config.branch_width

                def publish(ids, logp, _draft=tuple(draft.tokens), _base=len(committed), _deadline=deadline):
                    ids_np, logp_np = ids.cpu().numpy(), logp.cpu().numpy()
                    hints.append((ids_np, logp_np))
                    worker.draft_queue.put(Hint(_base, _draft, ids_np, logp_np, _deadline, max(1, schedule.k)))

                exit_spec = (exit_layer, kappa, publish)
            with timeline.span(VERIFY, "verify", k=len(draft.tokens)) as span_args:
                logits = verifier.score(committed, draft.tokens, early_exit=exit_spec)  # [k+1, V]
                n_accepted, new_tokens = verify(draft, logits, config, rng, history=committed)
                span_args["accepted"] = n_accepted
            t2 = time.perf_counter()
            verify_seconds = t2 - t1 if verify_seconds is None else 0.7 * verify_seconds + 0.3 * (t2 - t1)
            branch_outcome = None
            if worker is not None:
                branch_tokens = _drain(worker, look, epoch, len(committed), len(committed) if hints else None)
                on_lookahead = look.tokens[:len(new_tokens)] == new_tokens
                diverged = any(a != b for a, b in zip(look.tokens, new_tokens))  # not merely short
                committed.extend(new_tokens)
                limit = len(committed) + 2 * schedule.k + 1
                if on_lookahead:
                    del look.tokens[:len(new_tokens)], look.probs[:len(new_tokens)]
                    worker.draft_queue.put(Advance(len(committed), limit, n_accepted))
                else:
                    hit = branch_tokens.get((n_accepted, new_tokens[-1]))
                    if hints and (hit or diverged):
                        branch_outcome = "hit" if hit else "miss"
                    epoch += 1
                    look = _Lookahead(list(hit[0]) if hit else [], list(hit[1]) if hit else [],
                                      token_seconds=look.token_seconds)
                    worker.draft_queue.put(Rebase(epoch, tuple(committed), tuple(look.tokens), limit, n_accepted))
            else:
                committed.extend(new_tokens)
            if fallback is not None:
                try:
                    fallback.accepted(committed, n_accepted)
                except Exception as exc:
                    reason, fallback = _drop(fallback, exc), None
            generated += len(new_tokens)
            n_drafted = len(draft.tokens)
            if quick:  # the K schedule and alpha describe the model drafter; this step was the other one's
                quick_acceptance.update(n_drafted, n_accepted)
            else:
                draft_cost = n_drafted * look.token_seconds if worker is not None else t1 - t0
                if generated > len(new_tokens):  # the first step carries the prompt prefill
                    schedule.observe(n_drafted, draft_cost, t2 - t1)
                schedule.update(n_drafted, n_accepted)
                acceptance.update(n_drafted, n_accepted)
            if generated > len(new_tokens):  # the first step carries the prompt prefill
                gate.record(bool(draft.tokens), len(new_tokens), t2 - t0)
            yield Step(new_tokens, n_drafted, n_accepted, source, t1 - t0, t2 - t1, reason, branch_outcome)
            reason = None
    finally:
        if sharing is not None:
            sharing.close()
        if worker is not None:
            _stop_worker(worker)
        torch.set_num_threads(saved_threads)


def _propose_inline(drafter: Drafter, committed: list[int], budget: int, vocab_size: int,
                    timeline: Timeline) -> tuple[Draft, str | None]:
    """A draft from the model-free drafter on the verify worker's thread: (draft, reason it was dropped)."""
    try:
        with timeline.span(DRAFT, f"{drafter.name} draft"):
            draft = drafter.propose(committed, budget)
        _check_draft(draft, budget, vocab_size)
        return draft, None
    except Exception as exc:  # a failing drafter costs speed, never output
        return Draft.empty(), _drop(drafter, exc)


def _quick_pays(k_quick: int, alpha_quick: float, k_model: int, alpha_model: float, wait: float,
                verify_seconds: float) -> bool:
    """Whether verifying the model-free draft (k_quick tokens, now) commits more tokens per second than
    waiting `wait` seconds for the lookahead's k_model tokens: expected tokens per step (Leviathan) over
    the step's time. The worker keeps drafting meanwhile, so a quick step also shortens the next wait."""
    model_rate = expected_tokens_per_step(alpha_model, k_model) / (wait + verify_seconds)
    return expected_tokens_per_step(alpha_quick, k_quick) / verify_seconds > model_rate


def _fill(worker: DraftWorker, look: _Lookahead, epoch: int, committed_len: int, want: int,
          timeout: float) -> str | None:
    """Wait until the lookahead holds `want` tokens or the drafter has stalled. Returns a reason to drop
    the drafter (failed, garbage, timed out, worker gone), or None."""
    deadline = time.perf_counter() + timeout
    if len(look.tokens) < want:
        worker.draft_queue.put(Extend(committed_len + want + 1))
    while len(look.tokens) < want:
        if look.stalled_at is not None and look.stalled_at <= committed_len + len(look.tokens):
            return None
        left = deadline - time.perf_counter()
        if left <= 0:
            return _drop(worker.drafter, TimeoutError(f"no draft within {timeout:g} s"))
        try:
            msg = worker.verify_queue.get(timeout=min(left, 0.05))
        except queue.Empty:
            if not worker.thread.is_alive() and worker.verify_queue.empty():
                return _drop(worker.drafter, RuntimeError("the draft worker exited"))
            continue
        reason = _take(msg, look, epoch, committed_len, None, {})
        if reason:
            return _drop(worker.drafter, RuntimeError(reason))
    return None


def _drain(worker: DraftWorker, look: _Lookahead, epoch: int, committed_len: int,
           step_base: int | None) -> dict[tuple[int, int], tuple[list[int], list]]:
    """Everything the worker sent so far; returns this step's branches by (at, correction)."""
    branches: dict[tuple[int, int], tuple[list[int], list]] = {}
    while True:
        try:
            msg = worker.verify_queue.get_nowait()
        except queue.Empty:
            return branches
        if isinstance(msg, WorkerFailed):
            worker.verify_queue.put(msg)  # _fill reports it at the next step
            return branches
        _take(msg, look, epoch, committed_len, step_base, branches)


def _take(msg, look: _Lookahead, epoch: int, committed_len: int, step_base: int | None, branches: dict) -> str | None:
    if isinstance(msg, WorkerFailed):
        return msg.reason
    if isinstance(msg, Chunk) and msg.epoch == epoch and msg.pos == committed_len + len(look.tokens):
        look.tokens.extend(msg.tokens)
        look.probs.extend(msg.probs if msg.probs is not None else [None] * len(msg.tokens))
        per_token = msg.seconds / len(msg.tokens)
        look.token_seconds = per_token if not look.token_seconds else 0.8 * look.token_seconds + 0.2 * per_token
    elif isinstance(msg, Stalled) and msg.epoch == epoch:
        look.stalled_at = msg.pos
    elif isinstance(msg, BranchChunk) and msg.base_len == step_base:
        tokens, probs = branches.setdefault((msg.at, msg.correction), ([], []))
        tokens.extend(msg.tokens)
        probs.extend(msg.probs if msg.probs is not None else [None] * len(msg.tokens))
    return None


def _stop_worker(worker: DraftWorker) -> None:
    worker.stop(wait=0.5)
    if worker.thread.is_alive():
        log.warning("draft worker still busy in %r; it will exit when that call returns",
                    getattr(worker.drafter, "name", worker.drafter))


CPU_DRAFT_THREADS = 1
"""Threads a draft computing on the CPU gets while a CPU verifier runs beside it (torch threads of the
draft worker, or the intra-op threads of an ONNX Runtime session on the CPU provider)."""


def draft_on_cpu(drafter: Drafter | None) -> bool:
    """Whether the drafter's model computes on the CPU: a torch model on the CPU, or an export on ONNX
    Runtime's CPU provider (an export on Core ML or an NPU provider does not, though its logits land on
    the host)."""
    lm = getattr(drafter, "lm", None)
    if lm is None:
        return False
    provider = getattr(lm, "provider", None)
    if provider is not None:
        return provider == "CPUExecutionProvider"
    return lm.device.type == "cpu"


def shares_cpu(verifier_device: torch.device, drafter: Drafter | None) -> bool:
    """Whether target and draft would both compute on the CPU's cores."""
    return verifier_device.type == "cpu" and draft_on_cpu(drafter)


def cpu_draft_threads(verifier_device: torch.device) -> int | None:
    """Intra-op threads for an export loaded for the CPU provider beside this verifier (None: all)."""
    return CPU_DRAFT_THREADS if verifier_device.type == "cpu" else None


def overlap_threads(verifier_device: torch.device, drafter: Drafter | None) -> tuple[int, int] | None:
    """Split the CPU cores when both workers compute on it: CPU_DRAFT_THREADS for the draft, the rest for
    the verifier, which CoreSharing lends the draft's threads whenever the draft worker is idle."""
    if not shares_cpu(verifier_device, drafter):
        return None
    cores = torch.get_num_threads()
    return (max(1, cores - CPU_DRAFT_THREADS), CPU_DRAFT_THREADS)
