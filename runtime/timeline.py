"""Who was busy when: draft and verify lanes of one request, for stats and a Chrome trace.

Both workers append spans as they finish them. The time drafting overlapped verification (the draft
time hidden by the pipeline) is kept as a running sum: each new span is intersected with the spans
already recorded on the other lane, so every overlapping pair is counted once, when its later half
is recorded. Spans are appended at their end, so each lane is ordered by end time and the scan stops
at the first span that ended before the new one began.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from mirrorsd.results import Span

DRAFT, VERIFY = "draft", "verify"


class Timeline:
    def __init__(self) -> None:
        self.origin = time.perf_counter()
        self.spans: dict[str, list[tuple[float, float, str, dict]]] = {DRAFT: [], VERIFY: []}
        self.busy: dict[str, float] = {DRAFT: 0.0, VERIFY: 0.0}
        self.overlap = 0.0  # seconds during which both lanes were busy
        self._lock = threading.Lock()

    def add(self, lane: str, start: float, end: float, name: str, **args) -> None:
        other = self.spans[VERIFY if lane == DRAFT else DRAFT]
        with self._lock:
            for o_start, o_end, _, _ in reversed(other):
                if o_end <= start:
                    break
                self.overlap += max(0.0, min(end, o_end) - max(start, o_start))
            self.spans[lane].append((start, end, name, args))
            self.busy[lane] += end - start

    @contextmanager
    def span(self, lane: str, name: str, **args):
        start = time.perf_counter()
        try:
            yield args  # the caller may add args (e.g. how many tokens) before the span closes
        finally:
            self.add(lane, start, time.perf_counter(), name, **args)

    def to_spans(self) -> tuple[Span, ...]:
        """Every span, seconds from the timeline's origin (draft lane first)."""
        with self._lock:
            return tuple(Span(lane, name, start - self.origin, end - start, args.get("k", args.get("tokens", 0)),
                              args.get("accepted"))
                         for lane in (DRAFT, VERIFY) for start, end, name, args in self.spans[lane])

    def chrome_trace(self) -> dict:
        """The Trace Event Format that chrome://tracing, Perfetto and speedscope open."""
        events = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": f"{lane} worker"}}
                  for tid, lane in enumerate((DRAFT, VERIFY), 1)]
        for tid, lane in enumerate((DRAFT, VERIFY), 1):
            for start, end, name, args in self.spans[lane]:
                events.append({"name": name, "ph": "X", "pid": 1, "tid": tid, "cat": lane,
                               "ts": round((start - self.origin) * 1e6, 1),
                               "dur": round((end - start) * 1e6, 1), "args": args})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write_chrome_trace(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.chrome_trace()))
        return path
