"""CheckedDrafter: where a drafter's calls run, and how faults from either place drop it."""

from __future__ import annotations

import threading

import pytest

from mirrorsd import Draft, GenerationConfig
from mirrorsd.runtime.decode.drafting import CheckedDrafter
from mirrorsd.runtime.timeline import Timeline


class ThreadRecorder:
    """Proposes token 1; records the thread of each call; its feedback raises once `fail` is set."""

    name = "recorder"
    model = None
    learner = None

    def __init__(self, bounded: bool) -> None:
        self.bounded, self.threads, self.fail = bounded, [], False

    def start(self, config) -> None:
        self.threads.append(threading.get_ident())

    def propose(self, committed, max_tokens):
        self.threads.append(threading.get_ident())
        return Draft([1] * max_tokens, None, self.name)

    def accepted(self, committed, n_accepted) -> None:
        self.threads.append(threading.get_ident())
        if self.fail:
            raise RuntimeError("lost its state")


def source_for(drafter) -> CheckedDrafter:
    return CheckedDrafter(drafter, None, GenerationConfig(draft_timeout_s=2.0), 10, Timeline())


@pytest.mark.parametrize("bounded", [True, False])
def test_a_bounded_drafter_runs_on_the_calling_thread_and_any_other_on_a_helper_thread(bounded):
    drafter = ThreadRecorder(bounded)
    source = source_for(drafter)
    assert source.propose((5, 6), 3).tokens == [1, 1, 1]
    source.accepted((5, 6, 1), 0)
    assert source.propose((5, 6, 1), 2).tokens == [1, 1]
    source.close()
    here = threading.get_ident()
    assert len(drafter.threads) == 4 and len(set(drafter.threads)) == 1
    assert (drafter.threads[0] == here) is bounded


@pytest.mark.parametrize("bounded", [True, False])
def test_feedback_that_raises_drops_the_drafter_at_its_next_call(bounded):
    drafter = ThreadRecorder(bounded)
    source = source_for(drafter)
    source.propose((5, 6), 3)
    drafter.fail = True
    source.accepted((5, 6, 1), 0)  # posted: not waited for
    assert source.propose((5, 6, 1), 3).tokens == [] and not source.active
    assert "lost its state" in source.take_fallback()
    source.close()
