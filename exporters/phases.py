"""How an export talks: its phases (load, export, quantize, validate), each timed and announced to a
listener (the CLI's progress display), and the tools' own output kept out unless asked for."""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

# Loggers of the tools an export drives. onnxruntime's quantizer alone logs thousands of INFO lines per
# export (it sets the root logger to INFO on import); torch.onnx, onnxscript and torchvision warn on
# every graph about things the export already handles.
TOOL_LOGGERS = ("onnxruntime", "onnxscript", "onnx_ir", "torch.onnx", "torch.export", "torch._export",
                "torch._dynamo", "torchvision", "coremltools")


class PhaseListener(Protocol):
    def started(self, name: str) -> None: ...

    def finished(self, name: str, seconds: float | None, note: str) -> None:  # seconds None: skipped
        ...


class PhaseLog:
    """Times each phase of one export; `seconds` goes into the manifest."""

    def __init__(self, listener: PhaseListener | None = None) -> None:
        self.listener = listener
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str, note: str = "") -> Iterator[None]:
        if self.listener:
            self.listener.started(name)
        t0, ok = time.perf_counter(), False
        try:
            yield
            ok = True
        finally:
            self.seconds[name] = round(time.perf_counter() - t0, 2)
            if self.listener:
                self.listener.finished(name, self.seconds[name], note if ok else "FAILED")

    def skip(self, name: str, why: str) -> None:
        if self.listener:
            self.listener.finished(name, None, why)


class _BelowError(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


@contextmanager
def quiet_tools(verbose: bool = False) -> Iterator[None]:
    """Silence the tools' logs and warnings (errors still show) for the duration; `verbose` (or
    MIRRORSD_VERBOSE=1) keeps them. Our own output is prints and exceptions, so nothing of ours is lost."""
    if verbose or os.environ.get("MIRRORSD_VERBOSE"):
        yield
        return
    loggers = [logging.getLogger(name) for name in TOOL_LOGGERS]
    levels = [lg.level for lg in loggers]
    root_filter = _BelowError()  # records logged on the root logger itself (onnxruntime's logging.warning)
    logging.getLogger().addFilter(root_filter)
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tracing warns from torch, transformers and onnxscript modules alike
            yield
    finally:
        logging.getLogger().removeFilter(root_filter)
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
