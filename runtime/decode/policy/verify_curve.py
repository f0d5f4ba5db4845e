"""The target's verify-cost curve: what a pass over K drafted tokens costs, in plain decode steps.

The K schedule needs it before a request has tried each K: on llama.cpp's CPU kernels the curve is
neither linear nor monotone (a pass over 4 positions can cost less than one over 3, and a pass computes
the output head at every row), so it is measured, once per target object and process, on a short
context (well under a second on a small model, a few seconds on a 1.5B one), and kept here.
"""

from __future__ import annotations

import statistics
import time
import weakref

from mirrorsd.contracts import CausalLM

CONTEXT_TOKENS = 32
REPEATS = 2
MAX_K = 16  # measured up to here; a longer draft's cost comes from the request's own passes (VerifyCosts)

_curves: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def measure(lm: CausalLM, max_k: int, repeats: int = REPEATS) -> tuple[float, ...]:
    """Pass cost for K = 0..max_k drafted tokens in plain steps (index K; 1.0 at K = 0). Resets the cache."""
    token = min(100, lm.vocab_size - 1)
    context = [token] * CONTEXT_TOKENS
    try:
        lm.score(context, [token] * max_k)  # prefill and warm up every shape's code path once
        seconds = []
        for k in range(max_k + 1):
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                lm.score(context, [token] * k)  # the cache keeps the context: the pass feeds k + 1 positions
                times.append(time.perf_counter() - start)
            seconds.append(statistics.median(times))
    finally:
        lm.reset()
    return tuple(round(s / seconds[0], 3) for s in seconds)


def covers(curve: tuple[float, ...] | None, max_k: int) -> bool:
    """Whether a curve reaches max_k drafted tokens (as far as they are measured)."""
    return curve is not None and len(curve) > min(max_k, MAX_K)


def remember(lm: CausalLM, curve: tuple[float, ...]) -> None:
    """Keep a curve for this target (measured here, or read back from a CalibrationStore)."""
    try:
        _curves[lm] = tuple(curve)
    except TypeError:  # not weak-referenceable: no curve kept
        pass


def known(lm: CausalLM) -> tuple[float, ...] | None:
    """The curve measured for this target, if any (never measures)."""
    try:
        return _curves.get(lm)
    except TypeError:  # not weak-referenceable: no curve kept
        return None
