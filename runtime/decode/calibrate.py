"""pipeline="auto": overlap or sequential, decided from measured costs, once per placement.

The pipeline pays when drafting and verifying side by side take less time per step than one after the other.
Where the two models compute (CPU cores shared or split, an NPU, a GPU) changes what each costs when the other
runs beside it, so no rule about devices decides it: a short calibration measures, on the request's own
placement, a K-token verify pass and a draft token alone, then both again side by side, and predicts a step:

    sequential = K * draft_token + verify            (each model has its compute to itself, in turn)
    overlap    = max(K * draft_token', verify')      (the primed costs: measured side by side)

It takes a few seconds, once per (drafter, placement) and engine; `Engine.calibrations` keeps the results.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass

from mirrorsd.contracts import CausalLM, DraftModel
from mirrorsd.runtime.decode.threads import CorePins, pinned

OVERLAP_MARGIN = 0.95  # overlap must promise 5% or more: within that, sequential is the simpler schedule
CONTEXT_TOKENS = 64  # the calibration's context: a short prompt's worth
REPEATS = 3


@dataclass(frozen=True)
class Costs:
    """Seconds measured on one placement."""

    k: int
    verify_s: float  # a k-token verify pass, the verifier alone
    draft_token_s: float  # one draft token, the drafter alone
    verify_shared_s: float  # the same pass while the drafter drafts beside it
    draft_token_shared_s: float  # one draft token while the verifier verifies beside it

    @property
    def sequential_s(self) -> float:
        return self.k * self.draft_token_s + self.verify_s

    @property
    def overlap_s(self) -> float:
        return max(self.k * self.draft_token_shared_s, self.verify_shared_s)

    @property
    def mode(self) -> str:
        return "overlap" if self.overlap_s < OVERLAP_MARGIN * self.sequential_s else "sequential"

    def to_dict(self) -> dict:
        return {"k": self.k, "verify_s": self.verify_s, "draft_token_s": self.draft_token_s,
                "verify_shared_s": self.verify_shared_s, "draft_token_shared_s": self.draft_token_shared_s,
                "predicted_sequential_step_s": self.sequential_s, "predicted_overlap_step_s": self.overlap_s,
                "mode": self.mode}


def calibrate(verifier: CausalLM, drafter: DraftModel, k: int, pins: CorePins | None = None,
              threads: tuple[int, int] | None = None) -> Costs:
    """Measure `Costs` with the request's placement: pins (separate cores), or threads (verify, draft) the
    pipeline would give each side of a shared CPU. Both models' caches are reset afterwards."""
    draft_lm, token = drafter.lm, min(100, verifier.vocab_size - 1, drafter.lm.vocab_size - 1)
    context, draft = [token] * CONTEXT_TOKENS, [token] * k
    verify_core, draft_core = (pins.verify, pins.draft) if pins else (None, None)
    try:
        with pinned(verify_core, verifier.threads):
            verifier.score(context, [])  # prefill: the passes below score the draft only
            draft_lm.score(context, [])
            verify_s = _median(lambda: verifier.score(context, draft))
            draft_token_s = _median(lambda: draft_lm.score(context + context[:1], []))  # one decode step
            shared = _side_by_side(verifier, draft_lm, context, draft, draft_core, threads)
    finally:
        verifier.reset()
        draft_lm.reset()
    return Costs(k, verify_s, draft_token_s, *shared)


def _median(run) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _side_by_side(verifier: CausalLM, draft_lm: CausalLM, context: list[int], draft: list[int],
                  draft_core: int | None, threads: tuple[int, int] | None) -> tuple[float, float]:
    """Verify passes here while a thread drafts (decode steps on the draft model) until they are done."""
    done, counted = threading.Event(), []

    def drafting() -> None:
        control = draft_lm.threads
        with pinned(draft_core, control):
            saved = control.get_threads() if threads and control is not None else None
            if saved is not None:
                control.set_threads(threads[1])
            start, n = time.perf_counter(), 0
            while not done.is_set():
                draft_lm.score(context + context[:1] * (n % 16 + 1), [])  # decode steps, rolling back every 16
                n += 1
            counted.append((time.perf_counter() - start) / max(n, 1))
            if saved is not None:
                control.set_threads(saved)

    saved = verifier.threads.get_threads() if threads and verifier.threads is not None else None
    if saved is not None:
        verifier.threads.set_threads(threads[0])
    worker = threading.Thread(target=drafting, name="mirrorsd-calibrate", daemon=True)
    worker.start()
    try:
        time.sleep(0.01)  # let the draft side start
        verify_shared_s = _median(lambda: verifier.score(context, draft))
    finally:
        done.set()
        worker.join()
        if saved is not None:
            verifier.threads.set_threads(saved)
    return verify_shared_s, counted[0]
