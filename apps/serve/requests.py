"""The request layer both served APIs share (the OpenAI routes in apps/serve/openai_api.py, ollama's in
apps/serve/ollama_api.py): the single-engine queue (Runner, Job), waiting for a whole result while watching for a
client that left (collect), the errors a queue answers with, and checks on parsed JSON bodies."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.responses import JSONResponse

from mirrorsd.config import GenerationConfig, is_text
from mirrorsd.errors import RequestCancelled
from mirrorsd.results import FinishEvent, GenerationResult, TokenEvent

log = logging.getLogger("mirrorsd.server")


class OpenAIError(Exception):
    """An error answered as OpenAI's API answers it."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=self.body(), headers=self.headers)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def first_non_text(value, where: str = "") -> str | None:
    """The path of the first string (or key) in parsed JSON that does not encode as UTF-8, else None. Iterative:
    nesting of any depth costs no recursion."""
    stack = [(value, where)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            if not is_text(value):
                return where
            continue
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in reversed(list(items)):  # reversed: the first in document order is found first
            name = str(key).encode("utf-8", "backslashreplace").decode()  # the path itself must be text
            path = f"{where}.{name}" if where else name
            stack.append((item, path))
            if isinstance(key, str) and not is_text(key):
                stack.append((key, path))
    return None


def json_depth(value) -> int:
    """How deeply parsed JSON nests (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            deepest = max(deepest, depth + 1)
            stack.extend((item, depth + 1) for item in (value.values() if isinstance(value, dict) else value))
    return deepest


class Job:
    """One request's place in the queue; its events arrive on an asyncio queue."""

    def __init__(self, ids: list[int], config: GenerationConfig, loop: asyncio.AbstractEventLoop) -> None:
        self.ids, self.config, self.loop = ids, config, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.shutdown = False  # cancelled because the server is stopping: answered 503 / finish_reason "abort"
        self.state = "queued"  # -> "running" (the worker took it) or "dropped" (cancelled while it waited)
        self.on_cancel = lambda: None

    def cancel(self) -> None:
        self.cancelled.set()
        self.on_cancel()

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancel()


CANCELLED = object()


class Runner:
    """Runs requests in turn on one Engine in one worker thread, first come first served."""

    def __init__(self, engine, max_queue: int = 8) -> None:
        self.engine, self.max_queue = engine, max_queue
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mirrorsd-engine")
        self._state = threading.Lock()
        self.queued = 0
        self.running: TokenEvent | None = None  # the in-flight request's latest event (live stats)
        self.busy = False
        self.finished: Counter[str] = Counter()  # finish reasons of finished requests
        self.jobs: set[Job] = set()  # queued and running
        self.last_stats: dict | None = None
        self.closing = False

    def submit(self, ids: list[int], config: GenerationConfig) -> Job:
        job = Job(ids, config, asyncio.get_running_loop())
        with self._state:
            if self.closing:
                raise shutting_down()
            if self.queued >= self.max_queue:
                raise OpenAIError(429, f"the server is busy: {self.queued} requests are waiting (--max-queue "
                                  f"{self.max_queue}); retry shortly", "rate_limit_error", code="queue_full",
                                  headers={"Retry-After": "1"})
            self.queued += 1
            self.jobs.add(job)
        job.on_cancel = lambda: self._drop(job)
        self._pool.submit(self._work, job)
        return job

    def _drop(self, job: Job) -> None:
        """A queued job whose client left frees its queue slot at once (the worker skips it later)."""
        with self._state:
            if job.state != "queued":
                return
            job.state = "dropped"
            self.queued -= 1
            self.jobs.discard(job)
            self.finished["cancelled"] += 1

    def _work(self, job: Job) -> None:
        with self._state:
            if job.state == "dropped":
                return
            job.state = "running"
            self.queued -= 1
        if job.cancelled.is_set():  # its client left while it waited
            self._finish(job, "cancelled", None)
            job.put(CANCELLED)
            return
        self.busy = True
        reason, stats = "cancelled", None
        stream = None
        try:
            stream = self.engine.stream(job.ids, job.config, cancel=job.cancelled)  # stops a long prompt too
            for event in stream:
                if isinstance(event, FinishEvent):
                    reason, stats = event.result.finish_reason, event.result.stats.to_dict()
                else:
                    self.running = event
                job.put(event)
                if job.cancelled.is_set():
                    break
        except RequestCancelled:  # its client left mid-prompt: nothing to report, the next request goes on
            reason = "cancelled"
        except Exception as exc:  # reported to the client as an OpenAI error
            log.exception("generation failed")
            reason = "error"
            job.put(exc)
        finally:
            if stream is not None:
                stream.close()  # cancels the generation if it is still running
            self.running = None
            self.busy = False
            self._finish(job, reason, stats)
        if reason == "cancelled":
            job.put(CANCELLED)

    def _finish(self, job: Job, reason: str, stats: dict | None) -> None:
        with self._state:
            self.jobs.discard(job)
            self.finished[reason] += 1
            if stats is not None:
                self.last_stats = stats

    def health(self) -> dict:
        running = self.running
        return {"status": "ok", "busy": self.busy, "queued": self.queued, "finished": dict(self.finished),
                "current": running.stats.to_dict() if running is not None else None, "last": self.last_stats}

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def shut_down(self, running: bool) -> None:
        """Take no more requests and end the queued ones (and the running one if `running`): their handlers
        answer at once, a 503 or a stream's final chunk, without waiting for the worker to notice."""
        with self._state:
            self.closing = True
            jobs = [job for job in self.jobs if running or job.state == "queued"]
        for job in jobs:
            job.shutdown = True
            job.cancel()
            job.put(CANCELLED)


def shutting_down() -> OpenAIError:
    return OpenAIError(503, "the server is shutting down; retry on another server or after it restarts",
                       "server_error", code="server_shutting_down")


DISCONNECT_CHECK_S = 0.25


async def collect(job: Job, request: Request) -> GenerationResult | None:
    """Wait for the whole result, checking every DISCONNECT_CHECK_S (while tokens flow, too) that the
    client is still there: one that went away cancels its generation."""
    checked = time.monotonic()
    while True:
        try:
            item = await asyncio.wait_for(job.events.get(), timeout=DISCONNECT_CHECK_S)
        except TimeoutError:
            item = None
        if time.monotonic() - checked >= DISCONNECT_CHECK_S or item is None:
            checked = time.monotonic()
            if await request.is_disconnected():
                job.cancel()
                return None
        if item is None:
            continue
        if isinstance(item, FinishEvent):
            return item.result
        if item is CANCELLED:
            return None
        if isinstance(item, Exception):
            raise item
