"""The target's verify-cost curve: what a pass over K drafted tokens costs, in plain decode steps.

The K schedule needs it before a request has tried each K: on llama.cpp's CPU kernels the curve is
neither linear nor monotone (a pass over 4 positions can cost less than one over 3, and a pass computes
the output head at every row), so it is measured, once per target object and process, on a short
context (a second or two on a small model, about ten seconds on a 1.5B one on two cores), and kept here.
"""

from __future__ import annotations

import time
import weakref

from mirrorsd.contracts import CausalLM

CONTEXT_TOKENS = 32
REPEATS = 2
MAX_K = 16  # measured up to here; a longer draft's cost comes from the request's own passes (VerifyCosts)

STORE_KEY = "verify curve, paired passes"
"""What a CalibrationStore keeps the curve under (calibrate.py): named for how it is measured, so that a curve kept
by an earlier way of measuring is measured afresh."""

_curves: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def measure(lm: CausalLM, max_k: int, repeats: int = REPEATS) -> tuple[float, ...]:
    """Pass cost for K = 0..max_k drafted tokens in plain steps (index K; 1.0 at K = 0). Resets the cache.

    Each pass is timed right after a plain step, so that load from elsewhere on the machine slows the pair
    alike, and K's cost is the smaller of its pairs' ratios: load that starts, or a pause on one pass over K,
    upsets one pair only. What the smaller ratio can get wrong, it gets wrong low (load that ends, or a pause,
    between a pair's plain step and its pass), which the requests' own passes correct (VerifyCosts); a cost
    measured high would cut every model-free draft of that length (match_classes.py), so that no request's pass
    would measure it again, and the curve is kept across processes (calibrate.py)."""
    token = min(100, lm.vocab_size - 1)
    context = [token] * CONTEXT_TOKENS
    try:
        lm.score(context, [token] * max_k)  # prefill and warm up every shape's code path once
        curve = [1.0]
        for k in range(1, max_k + 1):
            ratios = []
            for _ in range(repeats):
                plain = _seconds(lm, context, 0)
                ratios.append(_seconds(lm, context, k) / plain)
            curve.append(round(min(ratios), 3))
    finally:
        lm.reset()
    return tuple(curve)


def _seconds(lm: CausalLM, context: list[int], k: int) -> float:
    """One pass over k + 1 positions: the cache keeps the context but its last token, which the pass feeds."""
    token = context[-1]
    start = time.perf_counter()
    lm.score(context, [token] * k)
    return time.perf_counter() - start


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
