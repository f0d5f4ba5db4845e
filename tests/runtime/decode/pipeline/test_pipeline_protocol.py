"""The pipeline's message protocol, piece by piece: the verify side's `take` / `fill` / `drain`, branch
planning, and a real DraftWorker thread driven by scripted drafters (no target model involved)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from mirrorsd import Draft, GenerationConfig
from mirrorsd.runtime.decode.pipeline.branches import Hint, plan_branches
from mirrorsd.runtime.decode.pipeline.lookahead import Lookahead, StepBranches, drain, fill, take
from mirrorsd.runtime.decode.pipeline.worker import (STOP, Advance, BranchChunk, BranchesPlanned, Chunk, DraftWorker, Rebase,
                                            Stalled, WorkerFailed)
from mirrorsd.runtime.timeline import Timeline

VOCAB = 100
TRUTH = list(range(10, 60))  # the "committed" history the scripted drafters continue


class Continues:
    """Proposes the continuation of TRUTH (or, off TRUTH, token 99 repeated); records every call."""

    name = "continues"
    model = None
    learner = None
    bounded = True

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []
        self.feedback: list[tuple[int, int]] = []

    def start(self, config) -> None:
        pass

    def propose(self, committed, max_tokens):
        self.calls.append((len(committed), max_tokens))
        n = len(committed)
        if list(committed) == TRUTH[:n]:
            return Draft(TRUTH[n:n + max_tokens], None, self.name)
        return Draft([99] * max_tokens, None, self.name)

    def accepted(self, committed, n_accepted):
        self.feedback.append((len(committed), n_accepted))


class Stalls(Continues):
    def propose(self, committed, max_tokens):
        return Draft([], None, self.name)


class Hangs(Continues):
    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def propose(self, committed, max_tokens):
        self.release.wait(10)
        return Draft([], None, self.name)


class Raises(Continues):
    def propose(self, committed, max_tokens):
        raise RuntimeError("NPU went away")


@pytest.fixture
def worker_for():
    started: list[DraftWorker] = []

    def make(drafter) -> DraftWorker:
        worker = DraftWorker(drafter, GenerationConfig(), Timeline(), VOCAB)
        assert worker.start()
        started.append(worker)
        return worker

    yield make
    for worker in started:
        worker.stop(wait=2)


# -- take: one message at a time -------------------------------------------------------------------

def test_take_keeps_contiguous_chunks_of_the_epoch_and_drops_the_rest():
    look, branches = Lookahead(epoch=3), StepBranches()
    assert take(Chunk(3, 20, (1, 2), None), look, 20, None, branches) is None
    take(Chunk(3, 23, (9,), None), look, 20, None, branches)  # a gap: position 22 never arrived
    take(Chunk(2, 22, (9,), None), look, 20, None, branches)  # a stale epoch
    take(Chunk(3, 22, (3,), None), look, 20, None, branches)
    assert look.tokens == [1, 2, 3] and look.probs == [None] * 3 and look.ranks == [None] * 3
    take(Stalled(2, 23), look, 20, None, branches)
    assert look.stalled_at is None
    take(Stalled(3, 23), look, 20, None, branches)
    assert look.stalled_at == 23
    assert take(WorkerFailed("boom"), look, 20, None, branches) == "boom"


def test_take_collects_this_steps_branches_only():
    look, branches = Lookahead(), StepBranches()
    q = np.full((2, VOCAB), 1.0 / VOCAB)
    assert branches.state((1, 7)) == "none" and branches.planned is None
    take(BranchesPlanned(19, ((0, 8),)), look, 20, 20, branches)  # an earlier step's plan
    take(BranchesPlanned(20, ((1, 7), (0, 3), (2, 5))), look, 20, 20, branches)
    assert branches.state((1, 7)) == "queued" and branches.state((0, 8)) == "none"
    take(BranchChunk(20, 1, 7, (4, 5), q), look, 20, 20, branches)
    assert branches.state((1, 7)) == "drafting"
    take(BranchChunk(20, 1, 7, (6,), None, True), look, 20, 20, branches)
    take(BranchChunk(20, 0, 3, (6,), None, False), look, 20, 20, branches)
    take(BranchChunk(19, 0, 8, (1,), None, True), look, 20, 20, branches)  # an earlier step's
    assert list(branches.drafted) == [(1, 7), (0, 3)]
    tokens, probs, ranks = branches.get((1, 7))
    assert tokens == [4, 5, 6] and len(probs) == 3 and probs[2] is None and ranks == [None] * 3
    assert branches.state((1, 7)) == "ready" and branches.state((0, 3)) == "drafting" and branches.ready == 1


def test_chunks_carry_the_drafts_candidates_into_the_lookahead():
    look = Lookahead()
    ids, logp = np.array([[1, 4], [2, 5]]), np.log(np.array([[0.6, 0.3], [0.9, 0.1]]))
    take(Chunk(0, 10, (1, 2), None, (ids, logp)), look, 10, None, StepBranches())
    assert look.candidates(1)[0].tolist() == [[1, 4], [2, 5]]  # k=1: the drafted position and the bonus one
    assert look.candidates(5)[0].shape == (2, 2)  # only what arrived
    look.advance(1)
    assert look.candidates(0)[0].tolist() == [[2, 5]]
    take(Chunk(0, 11, (3,), None), look, 10, None, StepBranches())  # a chunk without candidates
    assert look.candidates(1) is None


def test_lookahead_advance_and_rebase():
    look = Lookahead(tokens=[1, 2, 3], probs=[None] * 3, ranks=[None] * 3)
    look.advance(2)
    assert look.tokens == [3] and look.ranks == [None]
    look.rebase(([7, 8], [None, None], [None, None]))
    assert (look.epoch, look.tokens, look.stalled_at) == (1, [7, 8], None)
    look.rebase(None)
    assert (look.epoch, look.tokens) == (2, [])


# -- fill and drain against a real worker thread ---------------------------------------------------

def test_the_worker_drafts_the_lookahead_and_follows_advance_and_rebase(worker_for):
    drafter = Continues()
    worker = worker_for(drafter)
    look = Lookahead()
    worker.draft_queue.put(Rebase(0, tuple(TRUTH[:10]), (), 10 + 5, None))
    assert fill(worker, look, 10, 4, timeout=5) is None
    assert look.tokens[:4] == TRUTH[10:14]
    # the step accepted 3 tokens + 1: the worker keeps drafting the same lookahead
    look.advance(4)
    worker.draft_queue.put(Advance(14, 14 + 6, 3))
    assert fill(worker, look, 14, 5, timeout=5) is None
    assert look.tokens[:5] == TRUTH[14:19]
    assert (14, 3) in drafter.feedback
    # the target committed something else: a new epoch from the new history
    look.rebase(None)
    committed = tuple(TRUTH[:15]) + (98,)
    worker.draft_queue.put(Rebase(look.epoch, committed, (), len(committed) + 3, 0))
    assert fill(worker, look, len(committed), 3, timeout=5) is None
    assert look.tokens[:3] == [99, 99, 99]  # drafted from the new history, old chunks dropped


def test_fill_returns_early_when_the_drafter_stalls(worker_for):
    worker, look = worker_for(Stalls()), Lookahead()
    worker.draft_queue.put(Rebase(0, tuple(TRUTH[:10]), (), 20, None))
    assert fill(worker, look, 10, 4, timeout=5) is None
    assert look.tokens == [] and look.stalled_at == 10


def test_fill_reports_a_hung_drafter_after_the_timeout(worker_for):
    drafter = Hangs()
    worker, look = worker_for(drafter), Lookahead()
    worker.draft_queue.put(Rebase(0, tuple(TRUTH[:10]), (), 20, None))
    start = time.perf_counter()
    assert fill(worker, look, 10, 4, timeout=0.3) == "no draft within 0.3 s"
    assert time.perf_counter() - start < 3
    drafter.release.set()


def test_fill_reports_a_failing_drafter(worker_for):
    worker, look = worker_for(Raises()), Lookahead()
    worker.draft_queue.put(Rebase(0, tuple(TRUTH[:10]), (), 20, None))
    reason = fill(worker, look, 10, 4, timeout=5)
    assert reason is not None and "NPU went away" in reason


def test_drain_takes_what_arrived_and_keeps_a_failure_for_fill(worker_for):
    worker, look = worker_for(Raises()), Lookahead()
    worker.verify_queue.put(Chunk(0, 10, (1,), None))
    worker.verify_queue.put(WorkerFailed("gone"))
    assert drain(worker, look, 10, None).drafted == {}
    assert look.tokens == [1] and isinstance(worker.verify_queue.get_nowait(), WorkerFailed)


def test_the_worker_stops_on_stop(worker_for):
    worker = worker_for(Continues())
    worker.draft_queue.put(STOP)
    worker.thread.join(5)
    assert not worker.thread.is_alive()


# -- branch planning -------------------------------------------------------------------------------

def hint(draft, top_ids, top_p, deadline_in=1.0, branch_k=4, base=10) -> Hint:
    return Hint(base, tuple(draft), np.array(top_ids), np.log(np.array(top_p)), time.perf_counter() + deadline_in,
                branch_k)


def test_plan_branches_ranks_rejection_points_by_early_exit_probability():
    seq = TRUTH[:10] + [20, 21, 22]  # the lookahead: draft (20, 21) and its own bonus guess 22
    h = hint([20, 21], top_ids=[[20, 30], [21, 31], [22, 32]], top_p=[[0.6, 0.4], [0.5, 0.5], [0.9, 0.1]])
    plan = plan_branches(h, seq, token_seconds=0.01, now=time.perf_counter())
    got = [(b.at, b.correction, round(b.score, 3)) for b in plan.branches]
    # reject at 0 with 30: 0.4; reach 1 (0.6) then 31: 0.3; reach 2 (0.3) then 32: 0.03
    assert got == [(0, 30, 0.4), (1, 31, 0.3), (2, 32, 0.03)]
    assert plan.lookahead_score == pytest.approx(0.6 * 0.5 * 0.9)
    assert plan.branches[1].context == TRUTH[:10] + [20, 31]
    assert all(b.left == 4 for b in plan.branches)  # ~100 tokens of time: each gets max_tokens


def test_plan_branches_fits_the_time_left_and_skips_unlikely_ones():
    seq = TRUTH[:10] + [20]
    h = hint([20], top_ids=[[20, 30, 40], [50, 51, 52]], top_p=[[0.5, 0.49, 0.01], [0.4, 0.3, 0.3]],
             deadline_in=0.05)
    plan = plan_branches(h, seq, token_seconds=0.02, now=time.perf_counter())  # time for ~2 tokens
    assert [(b.at, b.correction) for b in plan.branches] == [(0, 30), (1, 50)]
    assert all(b.left == 1 for b in plan.branches)
    assert plan_branches(h, seq, token_seconds=None, now=time.perf_counter()).branches == []  # cost unknown


def test_the_worker_drafts_hinted_branches_best_first(worker_for):
    """Draft (20, 77) is under verification; 77 is wrong (the truth is 21). The branches, best first:
    reject at 1 with 21 (0.7 * 0.6), reject at 0 with 30 (0.3), then bonus tokens after both (0.7 * 0.4 *
    0.9 and * 0.1). Each is drafted from its own context: the (1, 21) branch continues the truth."""
    worker = worker_for(Continues())
    committed = tuple(TRUTH[:10])
    worker.draft_queue.put(Rebase(0, committed, (), len(committed), None))  # no room for a lookahead
    worker.token_seconds.update(0.001)
    worker.draft_queue.put(hint([20, 77], top_ids=[[20, 30], [77, 21], [22, 32]],
                                top_p=[[0.7, 0.3], [0.4, 0.6], [0.9, 0.1]], branch_k=2))
    chunks = []
    deadline = time.perf_counter() + 5
    while len(chunks) < 5 and time.perf_counter() < deadline:
        try:
            chunks.append(worker.verify_queue.get(timeout=0.1))
        except Exception:  # noqa: BLE001 - queue.Empty: keep waiting
            pass
    plan, chunks = chunks[0], chunks[1:]
    assert isinstance(plan, BranchesPlanned) and plan.keys == ((1, 21), (0, 30), (2, 22), (2, 32))
    assert [(c.at, c.correction) for c in chunks] == [(1, 21), (0, 30), (2, 22), (2, 32)]
    assert all(c.finished for c in chunks)
    assert chunks[0].tokens == tuple(TRUTH[12:14]) and chunks[1].tokens == (99, 99)
