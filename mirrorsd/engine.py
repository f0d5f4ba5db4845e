"""Engine: the public entry point. Text in, typed events out; the loops live in runtime/decode/."""

from __future__ import annotations

import contextlib
import logging
import numbers
import threading
import time
import warnings
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from mirrorsd.chat_tokens import chat_ids
from mirrorsd.config import GenerationConfig
from mirrorsd.contracts import CausalLM, Drafter, TokenLogprob
from mirrorsd.tools import check_tools, messages_for_template, template_takes_tools
from mirrorsd.errors import ConfigError, EngineBusyError, EngineClosedError, PromptError
from mirrorsd.results import Event, FinishEvent, GenerationResult, StatsRecorder, StepStats, TokenEvent
from mirrorsd.text_stream import StreamingText
from mirrorsd.runtime.backends import eos_ids as eos_ids_of
from mirrorsd.runtime.backends import load_lm
from mirrorsd.runtime.backends.base import PrefixCachedLM
from mirrorsd.runtime.backends.ggml_kernels import build_id as ggml_build_id
from mirrorsd.runtime.decode.policy import verify_curve
from mirrorsd.runtime.decode.policy.calibrate import Calibrations, CalibrationStore, Costs
from mirrorsd.runtime.decode.loop import run_plan
from mirrorsd.runtime.decode.plan import DecodePlan, make_plan
from mirrorsd.runtime.decode.policy.schedule import uses_cost_schedule
from mirrorsd.runtime.decode.verify import DecodeState
from mirrorsd.runtime.decode.pipeline.threads import CoreLayout, cpu_draft_threads, pinned
from mirrorsd.runtime.drafters.chain import ChainDrafter
from mirrorsd.runtime.drafters.factory import check_not_a_misspelt_keyword, helper_for, make_drafter
from mirrorsd.runtime.timeline import Timeline
from mirrorsd.runtime.decode.grammar import GrammarConstraint
from mirrorsd.structured import Grammars, grammar_text

log = logging.getLogger("mirrorsd")

Prompt = str | Sequence[dict] | Sequence[int]
"""A raw string, chat messages ([{"role": ..., "content": ...}], run through the chat template) or token ids."""


def with_settings(config: GenerationConfig, settings: dict) -> GenerationConfig:
    """`config` with some fields replaced; an unknown name is a ConfigError naming the known ones."""
    from dataclasses import fields, replace

    known = [f.name for f in fields(GenerationConfig) if f.init]
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise ConfigError(f"unknown generation setting(s): {', '.join(unknown)}", f"known: {', '.join(known)}")
    return replace(config, **settings)


def _kernels_of(lm: CausalLM) -> str:
    """The llama.cpp build a model's passes run on, for the key its measured costs are kept under (a rebuilt
    kernel changes them); nothing for another backend, which then needs no llama.cpp loaded."""
    return f", llama.cpp build {ggml_build_id()}" if lm.backend.startswith("llamacpp") else ""


def check_writable(path: str) -> None:
    """A file can be written at `path`: it is not a folder, and its folder exists and takes new files."""
    import os
    from pathlib import Path

    target = Path(path).expanduser().resolve()
    if target.is_dir() or not target.parent.is_dir() or not os.access(target.parent, os.W_OK):
        raise ConfigError(f"cannot write the trace to {path}: it is a folder, or {target.parent} is not a "
                          "writable folder", "pass a file path in an existing, writable folder")


CHAT_ROLES = ("system", "user", "assistant", "tool")


def check_messages(messages) -> list[dict]:
    """Chat messages as the template expects them: a known role and string content each (an assistant message
    that only calls tools may have none)."""
    messages = [{**m, "content": m.get("content") or ""} if m.get("tool_calls") else m for m in messages]
    for i, m in enumerate(messages):
        if m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str):
            raise PromptError(f"message {i} needs a role ({' | '.join(CHAT_ROLES)}) and string content, got "
                              f"role {m.get('role')!r} and content of type {type(m.get('content')).__name__}",
                              'e.g. {"role": "user", "content": "Hello"}')
        check_text(m["content"], f"message {i}'s content")
    return list(messages)


def check_text(text: str, what: str = "the prompt") -> str:
    """Text a tokenizer can take: a str that encodes as UTF-8 (no lone surrogates, as undecodable bytes
    in argv become), else a PromptError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PromptError(f"{what} is not valid Unicode text (a lone surrogate or undecodable byte at "
                          f"position {exc.start})", "send UTF-8 text") from None
    return text


class Engine:
    """A target model (a CausalLM on some backend) plus an optional drafter.

    Thread safety: calls are serialized, not batched. One request runs at a time (a lock taken when a
    stream starts and released when it finishes or is closed), so one Engine may be shared by threads;
    the others wait their turn. Use as a context manager or call close().

    target: a CausalLM (runtime/backends/), or a transformers model, run on the torch backend.
    helper: the model-free drafter beside a draft model (Engine.load: n-gram, see helper_for). The
    pipeline lets it serve steps where its draft beats waiting for the model's; it takes over when
    `drafter` fails mid-request. None: plain decoding takes over.
    eos_ids: token ids that end a reply (default: the tokenizer's EOS, and a transformers model's own)."""

    cores = CoreLayout()
    """Where the two sides compute on the CPU (runtime/decode/pipeline/threads.py). Default: cores shared. A benchmark's
    separate compute, simulated on one CPU (Linux; `mirrorsd bench --pin-devices`), pins the verify side to
    one core and the draft side to another, one compute thread each, in every pipeline mode."""

    allow_control_tokens = False
    """False (default): control-token text inside a chat message stays plain text (a client cannot forge a
    turn; mirrorsd/chat_tokens.py). True: it becomes control tokens, as a plain template render does."""

    def __init__(self, target, tokenizer, drafter: Drafter | None = None, device: torch.device | str | None = None,
                 name: str = "target", helper: Drafter | None = None, eos_ids: frozenset[int] | None = None) -> None:
        if isinstance(target, CausalLM):
            self.target = target
            default_eos = eos_ids_of(None, tokenizer)
        else:  # a transformers model: imported here, since the GGUF path needs none of transformers' modelling
            from mirrorsd.runtime.backends.torch_lm import TorchCausalLM

            self.target = TorchCausalLM(target, device)
            default_eos = eos_ids_of(target, tokenizer)
        self.tokenizer = tokenizer
        self.drafter = make_drafter(drafter, tokenizer, name)
        self.helper = helper
        self.name = name
        self.eos_ids = default_eos if eos_ids is None else frozenset(eos_ids)
        self.grammars = Grammars(tokenizer, self.target.vocab_size, self.eos_ids)
        # what speculation measured (verify-cost curve, draft costs); Engine.load names the models it keeps them under
        self.calibrated = Calibrations()
        self._lock = _RequestLock()  # one request at a time
        self.closed = False

    @classmethod
    def load(cls, target: str = "smollm2-135m", draft: str | Drafter | None = "auto", device: str | None = "auto",
             dtype: str | torch.dtype | None = "auto", draft_device: str | None = None,
             draft_dtype: str | torch.dtype | None = None, progress: bool = False,
             backend: str = "auto", draft_backend: str | None = None,
             allow_inexact: bool = False) -> "Engine":
        """Load a target and pick a drafter.

        draft: see mirrorsd.runtime.drafters.make_drafter: "auto" (best available; on a machine without
        an NPU the model-free chain), "ngram", "retrieval[:PATH]", "chain[:PATH]", "none"/None, a model
        argument for an independent draft model, an export folder, or a Drafter instance.
        device: the target's device. draft_device: a draft model's device, or
        the backend for an export (cpu, coreml, qnn, openvino, dml, vitisai, cuda).
        backend / draft_backend: the model backends (runtime/backends/): "auto" (llama.cpp for a GGUF model,
        i.e. every catalog model and .gguf files, where llama-cpp-python is installed; else torch),
        "llamacpp" (the GGUF as it is, on llama.cpp's kernels), "torch" (float32 reference).
        draft_backend defaults to backend.
        allow_inexact: draft "auto" speculates on a target whose verify passes are not batch-invariant
        (`exact_batches` False: greedy output may then part from target-only decoding where two logits
        nearly tie); without it such a target decodes alone, and says so.
        """
        if isinstance(draft, str):
            check_not_a_misspelt_keyword(draft)  # before the target loads: a typo should cost no load
        loaded = load_lm(target, backend, device=device, dtype=dtype, progress=progress)
        if draft == "auto" and not loaded.lm.exact_batches and not allow_inexact:
            log.warning("%s on %s: verify passes are not batch-invariant, so draft 'auto' does not speculate "
                        "(allow_inexact / --allow-inexact to speculate anyway)", target, loaded.lm.backend)
            draft = None
        drafter = make_drafter(draft, loaded.tokenizer, target, device=draft_device or device,
                               dtype=draft_dtype or dtype, backend=draft_backend or backend, progress=progress,
                               export_device=draft_device,
                               export_threads=cpu_draft_threads(loaded.lm.computes_on))
        engine = cls(loaded.lm, loaded.tokenizer, drafter, name=target, helper=helper_for(drafter),
                     eos_ids=loaded.eos_ids)
        from mirrorsd.catalog import calibrations_path

        # the backends as resolved ("auto" may pick another one once llama-cpp-python is installed)
        kept = engine.calibrated
        kept.target_id = (f"target {target} on {loaded.lm.backend} (device {device}, dtype {dtype}"
                          f"{_kernels_of(loaded.lm)})")
        kept.store = CalibrationStore(calibrations_path())
        if isinstance(draft, str) and drafter is not None and drafter.model is not None:
            kept.pair_id = (f"{kept.target_id}, draft {draft} on {drafter.model.lm.backend} (device "
                            f"{draft_device or device}, dtype {draft_dtype or dtype}{_kernels_of(drafter.model.lm)})")
        return engine

    def with_drafter(self, drafter: str | Drafter | None, helper: Drafter | None | str = "auto") -> "Engine":
        """The same target (model, caches, tokenizer, lock) with another drafter, e.g. to compare drafters
        on one loaded model. helper "auto": as Engine.load pairs them (n-gram beside a draft model)."""
        self._check_open()
        drafter = make_drafter(drafter, self.tokenizer, self.name)
        other = Engine(self.target, self.tokenizer, drafter, name=self.name,
                       helper=helper_for(drafter) if helper == "auto" else helper, eos_ids=self.eos_ids)
        other._lock = self._lock  # one request at a time on the shared target
        other.grammars, other.cores = self.grammars, self.cores
        other.calibrated.costs = self.calibrated.costs  # measured of the same target (keyed by drafter)
        return other

    # -- requests ---------------------------------------------------------------------------------

    def encode(self, prompt: Prompt, tools: list[dict] | None = None) -> list[int]:
        """Token ids for a prompt; chat messages go through the model's chat template, with `tools` (OpenAI-shaped
        function definitions, mirrorsd/tools.py) where the template takes them."""
        self._check_open()
        if isinstance(prompt, np.ndarray):
            prompt = prompt.tolist()
        if isinstance(prompt, str):
            if not prompt:
                raise PromptError("the prompt is empty", "give some text to continue, or chat messages")
            ids = self.tokenizer(check_text(prompt))["input_ids"]
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            if getattr(self.tokenizer, "chat_template", None) is None:
                raise PromptError(f"{self.name} has no chat template", "pass a plain string prompt instead")
            if tools is not None and not template_takes_tools(self.tokenizer):
                raise PromptError(f"{self.name}'s chat template has no tool calling",
                                  "use a model whose template takes tools (e.g. qwen2.5-coder-1.5b), or send no tools")
            messages = messages_for_template(check_messages(prompt))
            ids = chat_ids(self.tokenizer, messages, self.allow_control_tokens,
                           None if tools is None else check_tools(tools))
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                                       for t in prompt):
            ids = [int(t) for t in prompt]
            if any(not 0 <= t < self.target.vocab_size for t in ids):
                raise PromptError(f"prompt token ids must be in [0, {self.target.vocab_size}) for {self.name}",
                                  "encode text with this model's tokenizer (engine.encode)")
        else:
            raise PromptError(f"a prompt is a string, a list of chat messages or a list of token ids; got "
                              f"{type(prompt).__name__}" + (" of mixed items" if isinstance(prompt, (list, tuple))
                                                            else ""),
                              'e.g. "Hello", [{"role": "user", "content": "Hello"}] or [15496, 11]')
        ids = list(ids)
        if not ids:
            raise PromptError("the prompt is empty", "give some text to continue, or chat messages")
        limit = self.target.max_context
        if len(ids) >= limit:
            raise PromptError(
                f"the prompt is {len(ids)} tokens; {self.name}'s context window is {limit}",
                f"shorten the prompt to under {limit} tokens (leaving room for the reply)",
            )
        return ids

    def generate(self, prompt: Prompt, config: GenerationConfig | None = None, trace: str | None = None, *,
                 cancel: threading.Event | None = None, **settings) -> GenerationResult:
        """Run one request to completion (trace, cancel, settings: see stream)."""
        for event in self._run(*self._request(prompt, config, trace, settings), cancel):
            if isinstance(event, FinishEvent):
                return event.result
        raise AssertionError("stream ended without a FinishEvent")

    def stream(self, prompt: Prompt, config: GenerationConfig | None = None, trace: str | None = None,
               cancel: threading.Event | None = None, **settings) -> Iterator[Event]:
        """TokenEvents as tokens are committed, then one FinishEvent with the whole result.
        Closing the iterator early cancels the request (the draft worker, if any, is stopped).
        trace: a file to write the request's draft/verify timeline to, in Chrome's trace format.
        cancel: an event another thread may set to stop the request even mid-pass: a backend that feeds a long
        prompt in chunks (llama.cpp) stops between chunks, and the stream raises RequestCancelled.
        settings: GenerationConfig fields as keywords (`max_new_tokens=64, temperature=0.7`), applied over
        `config` (or the defaults)."""
        return self._run(*self._request(prompt, config, trace, settings), cancel)

    def _request(self, prompt: Prompt, config: GenerationConfig | None, trace: str | None,
                 settings: dict) -> tuple[list[int], GenerationConfig, str | None, GrammarConstraint | None]:
        """A request checked and prepared at the call, before its generator starts: a bad argument raises here."""
        self._check_open()
        cfg = config or GenerationConfig()
        if not isinstance(cfg, GenerationConfig):
            raise ConfigError(f"config must be a GenerationConfig, got {type(cfg).__name__}", "")
        if settings:
            cfg = with_settings(cfg, settings)
        ids = self.encode(prompt)
        self.prepare(cfg)  # measured before the request, not in it; a bad early_exit_layer is reported now
        if trace:
            check_writable(trace)  # now, not after the whole generation
        return ids, cfg, trace, self.constraint(cfg)

    def constraint(self, cfg: GenerationConfig) -> GrammarConstraint | None:
        """A fresh grammar state for a structured-output request (ConfigError for a bad grammar); None without."""
        grammar = grammar_text(cfg.json_schema, cfg.regex, cfg.grammar)
        return None if grammar is None else self.grammars.constraint(grammar)

    def pipeline_mode(self, cfg: GenerationConfig) -> str:
        """The mode `cfg.pipeline` resolves to with this drafter and target (see GenerationConfig). "auto" with a
        draft model: the mode a calibration on this core layout measured faster (runtime/decode/policy/calibrate.py;
        the first call per drafter and core layout takes a few seconds, then `calibrated` holds it)."""
        return self._plan(cfg, self.calibration).mode

    def _plan(self, cfg: GenerationConfig, calibration) -> DecodePlan:
        """The request's DecodePlan, with the calibration to use: locking (between requests) or not (inside one)."""
        mode = cfg.pipeline
        if mode == "auto":
            mode = (calibration(cfg.num_draft_tokens).mode
                    if self.drafter is not None and self.drafter.model is not None else "off")
        return make_plan(self.target, self.drafter, cfg, mode, self.cores)

    def prepare(self, config: GenerationConfig | None = None) -> None:
        """Measure what speculation with `config` needs on this core layout, between requests: the target's
        verify-cost curve (the K schedule's costs) and, with a draft model and pipeline "auto", the mode's
        calibration. Once per core layout, and kept across processes for models loaded by name; `stream` calls it
        before a request starts (a first request waits for it, but its time and stats hold none of it); call it
        after loading to pay it up front. ConfigError for a config this engine cannot plan."""
        cfg = config or GenerationConfig()
        with self._lock, pinned(self.cores.verify_core, self.target.threads):  # as the requests will run
            self._plan(cfg, self._calibration)
            if self.drafter is not None and uses_cost_schedule(cfg, self.drafter.model is not None):
                self.calibrated.verify_curve(self.target, self.cores, cfg.max_draft_tokens)

    def calibration(self, k: int) -> Costs:
        """Measured costs of this draft model beside this target on this core layout: kept per engine, and for
        models loaded by name across processes (`calibrated`, runtime/decode/policy/calibrate.py)."""
        with self._lock:  # the models are measured: no request runs meanwhile
            return self._calibration(k)

    def _calibration(self, k: int) -> Costs:
        """calibration, for a caller that holds the request lock."""
        return self.calibrated.pair(self.target, self.drafter, self.cores, k)

    @property
    def calibrations(self) -> dict[tuple, Costs]:
        """Deprecated: `calibrated.costs`."""
        warnings.warn("Engine.calibrations is deprecated: use Engine.calibrated.costs", DeprecationWarning, stacklevel=2)
        return self.calibrated.costs

    def _run(self, ids: list[int], cfg: GenerationConfig, trace: str | None,
             constraint: GrammarConstraint | None, cancel: threading.Event | None = None) -> Iterator[Event]:
        with self._lock, pinned(self.cores.verify_core, self.target.threads), \
                cancellable(self.target, cancel):  # pinned: the verify side is this thread
            self._check_open()
            start = time.perf_counter()
            plan = self._plan(cfg, self._calibration)  # calibrated by prepare, before the request
            timeline = Timeline()
            recorder = self._recorder(ids, plan, timeline)
            reply = _Reply(self.tokenizer, cfg, self.eos_ids)
            budget = min(cfg.max_new_tokens, self.target.max_context - len(ids))
            state = DecodeState(self.target, ids, cfg, budget, timeline, overlapped=plan.mode != "off",
                                constraint=constraint, model_drafts=self.drafter is not None
                                and self.drafter.model is not None)
            steps = run_plan(state, self.drafter, self.helper, plan)
            try:
                for index, step in enumerate(steps):
                    kept = reply.kept(step)
                    recorder.add(step, len(kept))
                    yield from reply.events(step, kept, index, recorder.snapshot(time.perf_counter() - start))
                    if reply.finish == "stop":
                        break
            except GeneratorExit:
                reply.finish = "cancelled"
                raise
            finally:
                steps.close()
                self._learn_from(ids, reply)
            recorder.values["generated_tokens"] = len(reply.tokens)  # a stop string may end the reply mid-step
            if trace:
                timeline.write_chrome_trace(trace)
            tail = reply.text.flush()
            yield FinishEvent(reply.result(recorder.snapshot(time.perf_counter() - start), timeline), tail)

    def _recorder(self, ids: list[int], plan: DecodePlan, timeline: Timeline) -> StatsRecorder:
        chain = tuple(d.name for d in self.drafter.drafters) if isinstance(self.drafter, ChainDrafter) else ()
        # prompt caching: the prefix this request shares with the cache (at least one token is always fed)
        cached = min(self.target.cached_prefix(ids), len(ids) - 1)
        return StatsRecorder(timeline, prompt_tokens=len(ids), cached_prompt_tokens=cached, pipeline=plan.mode,
                             backend=self.target.backend, chain=chain,
                             exact=self.drafter is None or self.target.exact_batches,
                             verify_curve=verify_curve.known(self.target) or ())

    def _learn_from(self, ids: list[int], reply: "_Reply") -> None:
        """A learning drafter (a datastore) takes in a finished reply; learning is best-effort."""
        learner = self.drafter.learner if self.drafter is not None else None
        if learner is not None and reply.finish != "cancelled":
            try:
                learner.finish(ids, reply.tokens)
            except Exception as exc:  # the reply is already right
                log.warning("drafter %r could not learn from the request: %s", self.drafter, exc)

    # -- lifecycle --------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every model's KV cache (the target's and a draft model's): the next request prefills its
        whole prompt, as a first request does. Otherwise a request reuses the longest prefix it shares with
        the one before (prompt caching: a chat's next turn prefills only the new turn), which
        `stats.cached_prompt_tokens` reports. Benchmarks reset before every timed request."""
        with self._lock:
            self._check_open()
            self.target.reset()
            for drafter in (self.drafter, self.helper):
                if drafter is not None and drafter.model is not None:
                    drafter.model.lm.reset()

    def close(self) -> None:
        """Wait for a running request to finish (its draft worker thread ends with it), then free the
        KV caches, drop the models (so their device memory can be released) and close the drafters
        (their `close()`, if they have one). Calls after close() raise EngineClosedError; closing
        twice is a no-op."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            for drafter in (self.drafter, self.helper):
                if drafter is not None and drafter.model is not None:
                    drafter.model.close()
            self.target.close()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def _check_open(self) -> None:
        if self.closed:
            raise EngineClosedError(f"this Engine ({self.name}) has been closed",
                                    "load a new Engine, or keep using it inside its `with` block")

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Reply:
    """The reply as steps commit it: its tokens (up to EOS), their text (cut at a stop string), their
    log-probabilities, and why it ended ("length" until EOS or a stop string says "stop")."""

    def __init__(self, tokenizer, cfg: GenerationConfig, eos_ids: frozenset[int]) -> None:
        self.text = StreamingText(tokenizer, cfg.stop)
        self.eos_ids = eos_ids
        self.tokens: list[int] = []
        self.from_draft: list[bool] = []
        self.logprobs: list[TokenLogprob] | None = None if cfg.logprobs is None else []
        self.finish = "length"

    def kept(self, step) -> list[int]:
        """The step's tokens up to and including an EOS, which ends the reply."""
        for j, token in enumerate(step.tokens):
            if token in self.eos_ids:
                self.finish = "stop"
                return step.tokens[: j + 1]
        return step.tokens

    def events(self, step, kept: list[int], index: int, stats) -> Iterator[TokenEvent]:
        delta = StepStats(step.drafted_tokens, step.accepted_tokens, len(kept), step.source, step.draft_time_s, step.verify_time_s)
        for j, token in enumerate(kept):
            self.tokens.append(token)
            self.from_draft.append(j < step.accepted_tokens)
            logprob = None if step.logprobs is None else step.logprobs[j]
            if self.logprobs is not None:
                self.logprobs.append(logprob)
            piece, stopped = self.text.push(token)
            yield TokenEvent(token, piece, j < step.accepted_tokens, index, stats, logprob, delta)
            if stopped:
                self.finish = "stop"
                return

    def result(self, stats, timeline: Timeline) -> GenerationResult:
        return GenerationResult(self.text.text, self.tokens, self.finish, stats, self.from_draft,
                                timeline.to_spans(), self.logprobs)


@contextlib.contextmanager
def cancellable(target: CausalLM, cancel: threading.Event | None):
    """The request's cancel flag on a target that checks one mid-pass (our backends), for the request's duration."""
    if cancel is None or not isinstance(target, PrefixCachedLM):
        yield
        return
    target.cancel = cancel
    try:
        yield
    finally:
        target.cancel = None


class _RequestLock:
    """The engine's one-request-at-a-time lock. A plain Lock, not an RLock: a stream may be closed (and so
    release it) on another thread than the one that started it, e.g. by the garbage collector. A call from
    the thread whose open stream holds it would wait for ever: it raises EngineBusyError instead."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    def __enter__(self) -> "_RequestLock":
        if self._owner == threading.get_ident():
            raise EngineBusyError("a stream of this Engine is still open on this thread",
                                  "read the stream to its end or close() it before the next call")
        self._lock.acquire()
        self._owner = threading.get_ident()
        return self

    def __exit__(self, *exc) -> None:
        self._owner = None
        self._lock.release()
