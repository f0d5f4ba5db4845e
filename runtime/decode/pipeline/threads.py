"""CPU threads when the draft and the target compute on the same CPU: who gets which cores.

CoreLayout decides whether they do (`shares_cpu`); when they do, the pipeline splits the cores
(`overlap_threads`) and `CoreSharing` lends the draft's threads to the verify pass whenever the draft
worker is idle. Both need the target to declare ThreadControl; without it nothing is switched.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

from mirrorsd.contracts import CausalLM, ComputeKind, Drafter, ThreadControl, computes_on

CPU_DRAFT_THREADS = 1
"""Threads a draft computing on the CPU gets while a CPU target runs beside it (torch threads of the
draft worker, or the intra-op threads of an ONNX Runtime session on the CPU provider)."""


def leave_signals_to_the_main_thread() -> None:
    """Block Ctrl-C / SIGTERM in the calling background thread. The kernel hands a process-directed signal to
    any thread that does not block it; one that lands on a background thread does not wake the main thread,
    which may then sit out a whole reply before it sees the KeyboardInterrupt."""
    import signal
    import sys

    if sys.platform != "win32":  # POSIX; on Windows Ctrl-C reaches the main thread anyway
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})


@dataclass(frozen=True)
class CoreLayout:
    """Where a request's two sides compute on the CPU. By default (no cores) wherever the OS puts them, the
    threads split by `overlap_threads` where both compute on the CPU. Pinned (separate compute, simulated on one
    CPU, for side-by-side measurements): the verify side (the request's thread) on `verify_core`, the draft side
    (the drafter's own thread, or the pipeline's draft worker) on `draft_core`, one compute thread each, in
    every pipeline mode -- so sequential decoding gets exactly the compute the pipeline gets. Pinning needs
    per-thread CPU affinity (Linux) and two different usable cores (ConfigError otherwise)."""

    verify_core: int | None = None
    draft_core: int | None = None

    def __post_init__(self) -> None:
        if self.verify_core is None and self.draft_core is None:
            return
        from mirrorsd.errors import ConfigError

        if not hasattr(os, "sched_setaffinity"):
            raise ConfigError("core pinning needs per-thread CPU affinity (Linux)", "run without pinning")
        usable = os.sched_getaffinity(0)
        if self.verify_core == self.draft_core or not {self.verify_core, self.draft_core} <= usable:
            raise ConfigError(f"pinning needs two different usable cores, got {self.verify_core} and "
                              f"{self.draft_core}", f"usable cores here: {sorted(usable)}")

    @classmethod
    def first_two(cls) -> CoreLayout:
        """The verify side on the first usable core, the draft side on the second."""
        usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        return cls(*(usable + [-1, -1])[:2])  # too few cores: __post_init__ says so

    @property
    def pinned(self) -> bool:
        return self.draft_core is not None

    def describe(self) -> str:
        return (f"verify on core {self.verify_core}, draft on core {self.draft_core}" if self.pinned
                else "cores shared")


class CorePins(CoreLayout):
    """Deprecated spelling of a pinned CoreLayout: CorePins(verify, draft) is CoreLayout(verify, draft)."""

    def __init__(self, verify: int, draft: int) -> None:
        warnings.warn("CorePins is deprecated: use CoreLayout(verify_core, draft_core)", DeprecationWarning,
                      stacklevel=2)
        super().__init__(verify, draft)

    def layout(self) -> CoreLayout:
        return CoreLayout(self.verify_core, self.draft_core)


@contextmanager
def pinned(core: int | None, control: ThreadControl | None = None):
    """Run the calling thread on `core` alone with one compute thread (`control`: the model whose passes this
    thread runs, if its threads can be set); restores both on exit. core None: no change."""
    if core is None:
        yield
        return
    mask = os.sched_getaffinity(0)
    saved = control.get_threads() if control is not None else None
    os.sched_setaffinity(0, {core})  # pid 0: the calling thread only
    if control is not None:
        control.set_threads(1)
    try:
        yield
    finally:
        if control is not None:
            control.set_threads(saved)
        os.sched_setaffinity(0, mask)


def draft_control(drafter: Drafter | None) -> ThreadControl | None:
    """The thread control of a draft model's backend, where it declares one."""
    return drafter.model.lm.threads if drafter is not None and drafter.model is not None else None


def shares_cpu(target: CausalLM, drafter: Drafter | None) -> bool:
    """Whether target and draft would both compute on the CPU's cores."""
    return target.computes_on == "cpu" and computes_on(drafter) == "cpu"


def cpu_draft_threads(target_computes_on: ComputeKind) -> int | None:
    """Intra-op threads for an export loaded for the CPU provider beside this target (None: all)."""
    return CPU_DRAFT_THREADS if target_computes_on == "cpu" else None


def overlap_threads(target: CausalLM, drafter: Drafter | None) -> tuple[int, int] | None:
    """(verify, draft) threads when both workers compute on the CPU: CPU_DRAFT_THREADS for the draft, the
    rest of the target's threads for it, and CoreSharing lends it the draft's whenever the draft worker
    is idle. None when they do not share the CPU (or the target's threads cannot be set)."""
    if not shares_cpu(target, drafter) or target.threads is None:
        return None
    return (max(1, target.threads.get_threads() - CPU_DRAFT_THREADS), CPU_DRAFT_THREADS)


class CoreSharing:
    """A work-conserving split of the CPU between the two workers: the verify pass runs on its own
    threads while the draft worker drafts, and takes the draft's threads too whenever the worker is
    idle (its lookahead is full), switching between decoder layers. A verify pass is most of a step and
    runs far faster on every core; drafting K tokens is the short part, so a fixed split would leave the
    draft's core idle for the rest of the pass."""

    def __init__(self, control: ThreadControl, worker_drafting, threads: tuple[int, int]) -> None:
        """worker_drafting: a callable, True while the draft worker computes."""
        self.control, self.worker_drafting, self.threads = control, worker_drafting, threads
        self.current: int | None = None
        self._remove = control.between_layers(self._before_layer)

    def _before_layer(self) -> None:
        want = self.threads[0] + (0 if self.worker_drafting() else self.threads[1])
        if want != self.current:
            self.control.set_threads(want)
            self.current = want

    def close(self) -> None:
        if self._remove is not None:
            self._remove()
            self._remove = None
