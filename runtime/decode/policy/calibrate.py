"""pipeline="auto": overlap or off, decided from measured costs, once per core layout.

The pipeline pays when drafting and verifying side by side take less time per step than one after the other.
Where the two models compute (CPU cores shared or split, an NPU, a GPU) changes what each costs when the other
runs beside it, so no rule about devices decides it: a short calibration measures, on the request's own
core layout, a K-token verify pass and a draft token alone, then both again side by side, and predicts a step:

    sequential = K * draft_token + verify            (each model has its compute to itself, in turn)
    overlap    = max(K * draft_token', verify')      (the primed costs: measured side by side)

It takes a few seconds, once per (drafter, core layout) and engine; an engine's `Calibrations` keeps the results
(and the target's verify-cost curve), and for models loaded by name (`Engine.load`) a `CalibrationStore` keeps them
across processes, so a later run on the same machine, models and core layout reuses them.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path

from mirrorsd.contracts import CausalLM, Drafter, DraftModel
from mirrorsd.runtime.decode.pipeline.threads import CoreLayout, overlap_threads, pinned
from mirrorsd.runtime.decode.policy import verify_curve

log = logging.getLogger("mirrorsd")

OVERLAP_MARGIN = 0.95  # overlap must promise 5% or more: within that, the pipeline stays off (the simpler schedule)
CONTEXT_TOKENS = 64  # the calibration's context: a short prompt's worth
REPEATS = 3


@dataclass(frozen=True)
class Costs:
    """Seconds measured on one core layout."""

    k: int
    verify_s: float  # a k-token verify pass, the target alone
    draft_token_s: float  # one draft token, the drafter alone
    verify_shared_s: float  # the same pass while the drafter drafts beside it
    draft_token_shared_s: float  # one draft token while the target verifies beside it

    @property
    def sequential_s(self) -> float:
        return self.k * self.draft_token_s + self.verify_s

    @property
    def overlap_s(self) -> float:
        return max(self.k * self.draft_token_shared_s, self.verify_shared_s)

    @property
    def mode(self) -> str:
        return "overlap" if self.overlap_s < OVERLAP_MARGIN * self.sequential_s else "off"

    @classmethod
    def from_dict(cls, d: dict) -> Costs:
        """The inverse of to_dict; ValueError for anything that is not a measured Costs."""
        values = {f.name: d[f.name] for f in fields(cls)}
        if not isinstance(values["k"], int) or values["k"] < 1 or any(
                not isinstance(v, (int, float)) or not 0 < v < float("inf") for v in values.values()):
            raise ValueError(f"not a calibration: {d!r}")
        return cls(**values)

    def to_dict(self) -> dict:
        return {"k": self.k, "verify_s": self.verify_s, "draft_token_s": self.draft_token_s,
                "verify_shared_s": self.verify_shared_s, "draft_token_shared_s": self.draft_token_shared_s,
                "predicted_sequential_step_s": self.sequential_s, "predicted_overlap_step_s": self.overlap_s,
                "mode": self.mode}


def calibrate(target: CausalLM, drafter: DraftModel, k: int, cores: CoreLayout = CoreLayout(),
              threads: tuple[int, int] | None = None) -> Costs:
    """Measure `Costs` with the request's core layout: pinned (separate cores), or threads (verify, draft) the
    pipeline would give each side of a shared CPU. Both models' caches are reset afterwards."""
    draft_lm, token = drafter.lm, min(100, target.vocab_size - 1, drafter.lm.vocab_size - 1)
    context, draft = [token] * CONTEXT_TOKENS, [token] * k
    verify_core, draft_core = cores.verify_core, cores.draft_core
    try:
        with pinned(verify_core, target.threads):
            target.score(context, [])  # prefill: the passes below score the draft only
            draft_lm.score(context, [])
            verify_s = _median(lambda: target.score(context, draft))
            draft_token_s = _median(lambda: draft_lm.score(context + context[:1], []))  # one decode step
            shared = _side_by_side(target, draft_lm, context, draft, draft_core, threads)
    finally:
        target.reset()
        draft_lm.reset()
    return Costs(k, verify_s, draft_token_s, *shared)


def _median(run) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _side_by_side(target: CausalLM, draft_lm: CausalLM, context: list[int], draft: list[int],
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

    saved = target.threads.get_threads() if threads and target.threads is not None else None
    if saved is not None:
        target.threads.set_threads(threads[0])
    worker = threading.Thread(target=drafting, name="mirrorsd-calibrate", daemon=True)
    worker.start()
    try:
        time.sleep(0.01)  # let the draft side start
        verify_shared_s = _median(lambda: target.score(context, draft))
    finally:
        done.set()
        worker.join()
        if saved is not None:
            target.threads.set_threads(saved)
    return verify_shared_s, counted[0]


class CalibrationStore:
    """Calibrations kept across processes: a JSON object in `path` mapping a key (the models as loaded, the
    core layout, K, the machine and mirrorsd's version: see `key`) to `Costs`, or to the target's verify-cost
    curve (runtime/decode/policy/verify_curve.py). Writes hold a file lock and
    replace the file atomically, so concurrent processes never interleave. A file that cannot be read (or an
    entry that is not a calibration) is treated as absent: the calibration runs again and the file is
    rewritten. Delete the file to recalibrate."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    @staticmethod
    def key(models: str, cores: CoreLayout, k: int | str, machine: str) -> str:
        """models: the models as loaded; k: the draft length measured (or verify_curve.STORE_KEY); machine: what else the
        costs depend on (devices.machine_id())."""
        from mirrorsd import __version__

        what = f"K={k}" if isinstance(k, int) else k
        return " | ".join((models, cores.describe(), what, machine, f"mirrorsd {__version__}"))

    def get(self, key: str) -> Costs | None:
        try:
            return Costs.from_dict(self._read()[key])
        except (KeyError, ValueError, TypeError):
            return None

    def put(self, key: str, costs: Costs) -> None:
        self._put(key, {f.name: getattr(costs, f.name) for f in fields(Costs)})

    def get_curve(self, key: str) -> tuple[float, ...] | None:
        """A verify-cost curve (runtime/decode/policy/verify_curve.py) kept under key: 1.0 at K = 0, every cost positive."""
        curve = self._read().get(key)
        if (isinstance(curve, list) and curve and curve[0] == 1.0
                and all(isinstance(c, (int, float)) and not isinstance(c, bool) and 0 < c < float("inf") for c in curve)):
            return tuple(float(c) for c in curve)
        return None

    def put_curve(self, key: str, curve: tuple[float, ...]) -> None:
        self._put(key, list(curve))

    def get_verdict(self, key: str) -> bool | None:
        """A yes/no measurement kept under key (a backend's batch-invariance check on this device)."""
        verdict = self._read().get(key)
        return verdict if isinstance(verdict, bool) else None

    def put_verdict(self, key: str, verdict: bool) -> None:
        self._put(key, bool(verdict))

    def _put(self, key: str, value) -> None:
        from filelock import FileLock

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(self.path) + ".lock"):
                entries = self._read()
                entries[key] = value
                tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(entries, indent=1))
                os.replace(tmp, self.path)
        except OSError as exc:  # a read-only cache costs the next run a calibration, nothing else
            log.warning("could not keep the calibration in %s: %s", self.path, exc)

    def _read(self) -> dict:
        try:
            entries = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable calibrations in %s (%s); measuring afresh", self.path, exc)
            return {}
        return entries if isinstance(entries, dict) else {}


class Calibrations:
    """What one engine measured once per core layout: the target's verify-cost curve (the K schedule's costs) and,
    per (drafter, core layout, K), a draft model's costs beside the target (`pipeline="auto"`), kept in `costs`. For
    models loaded by name, `store` keeps both across processes: the curve under `target_id` (the target as
    loaded), the costs under `pair_id` (the target beside the draft model as loaded); None: this engine only.
    Measuring runs the models: the caller holds the engine's request lock."""

    def __init__(self) -> None:
        self.costs: dict[tuple, Costs] = {}
        self.store: CalibrationStore | None = None
        self.target_id: str | None = None
        self.pair_id: str | None = None

    def pair(self, target: CausalLM, drafter: Drafter, cores: CoreLayout, k: int) -> Costs:
        """The draft model's costs beside the target at draft length k on this core layout, measured once."""
        key = (id(drafter), cores, max(1, k))
        if key not in self.costs:
            kept = self._store_key(key[2], self.pair_id, cores)
            costs = None if kept is None else self.store.get(kept)
            if costs is None:
                threads = None if cores.pinned else overlap_threads(target, drafter)
                costs = calibrate(target, drafter.model, key[2], cores, threads)
                if kept is not None:
                    self.store.put(kept, costs)
            self.costs[key] = costs
            log.info("pipeline auto: %s", costs.to_dict())
        return self.costs[key]

    def verify_curve(self, target: CausalLM, cores: CoreLayout, max_k: int) -> None:
        """The target's verify-cost curve up to max_k, measured once and remembered for the target
        (verify_curve.known)."""
        if verify_curve.covers(verify_curve.known(target), max_k):
            return
        kept = self._store_key(verify_curve.STORE_KEY, self.target_id, cores)
        curve = None if kept is None else self.store.get_curve(kept)
        if not verify_curve.covers(curve, max_k):
            curve = verify_curve.measure(target, min(max_k, verify_curve.MAX_K))
            if kept is not None:
                self.store.put_curve(kept, curve)
        verify_curve.remember(target, curve)

    def _store_key(self, what: int | str, models: str | None, cores: CoreLayout) -> str | None:
        """The key under which `store` keeps `what`, measured of `models` here (None: not kept)."""
        if self.store is None or models is None:
            return None
        from mirrorsd.devices import machine_id

        return CalibrationStore.key(models, cores, what, machine_id())
