"""Engine: the public entry point. Text in, typed events out; the loop lives in runtime/speculative.py."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence

import torch

from mirrorsd.config import GenerationConfig
from mirrorsd.contracts import Drafter
from mirrorsd.errors import ConfigError, EngineClosedError, PromptError
from mirrorsd.results import Event, FinishEvent, GenerationResult, StatsRecorder, TokenEvent
from mirrorsd.runtime.backends.cpu_kernels import use_onednn_linear
from mirrorsd.runtime.drafters import ChainDrafter, NGramDrafter, RetrievalDrafter, TorchDraftModel
from mirrorsd.runtime.decode.pipeline import cpu_draft_threads, overlap_threads, pipelined_decode, shares_cpu
from mirrorsd.runtime.decode.sequential import speculative_decode
from mirrorsd.runtime.timeline import Timeline
from mirrorsd.runtime.backends.torch_lm import TorchCausalLM
from mirrorsd.tokenizer_check import check_tokenizers_match

log = logging.getLogger("mirrorsd")

Prompt = str | Sequence[dict] | Sequence[int]
"""A raw string, chat messages ([{"role": ..., "content": ...}], run through the chat template) or token ids."""


class Engine:
    """A target model plus an optional drafter.

    Thread safety: calls are serialized, not batched. One request runs at a time (a lock taken when a
    stream starts and released when it finishes or is closed), so one Engine may be shared by threads;
    the others wait their turn. Use as a context manager or call close().

    fallback: the model-free drafter beside a draft model (Engine.load: n-gram, see fallback_for). The
    pipeline lets it serve steps where its draft beats waiting for the model's; it takes over when
    `drafter` fails mid-request. None: plain decoding takes over."""

    def __init__(self, model, tokenizer, drafter: Drafter | None = None, device: torch.device | str | None = None,
                 name: str = "target", fallback: Drafter | None = None) -> None:
        self.verifier = TorchCausalLM(model, device)
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.fallback = fallback
        self.name = name
        self.eos_ids = _eos_ids(model, tokenizer)
        self._lock = threading.Lock()
        self.closed = False

    @classmethod
    def load(cls, target: str = "smollm2-135m", draft: str | Drafter | None = "auto", device: str | None = "auto",
             dtype: str | torch.dtype | None = "auto", draft_device: str | None = None,
             draft_dtype: str | torch.dtype | None = None, progress: bool = False,
             verifier_device: str | None = None) -> "Engine":
        """Load a target and pick a drafter.

        draft: "auto" (best available; today the model-free chain: n-gram + retrieval from the default
        stdlib datastore, built once per tokenizer), "ngram", "retrieval" / "chain" (default datastore),
        "retrieval:PATH" / "chain:PATH" (your datastore, learning from each reply), "none"/None
        (target-only decoding through the same runtime), a model argument (catalog name, folder, .gguf,
        hub id) for an independent torch draft model, an export folder (`mirrorsd export`, holding
        manifest.json) for a draft on ONNX Runtime / Core ML, or a Drafter instance. With an NPU and a
        compatible export in the exports cache, "auto" drafts with that export on the NPU.
        device / verifier_device (alias): the target's torch device. draft_device: a torch device for a
        torch draft model, or a backend for an export (cpu, coreml, qnn, openvino, dml, vitisai, cuda).
        """
        from mirrorsd.devices import parse_dtype, resolve_device
        from mirrorsd.models import load_model

        device = verifier_device or device
        dev = resolve_device(device)
        model, tokenizer = load_model(target, dev, parse_dtype(dtype, dev), progress)
        use_onednn_linear(model)
        drafter = _make_drafter(draft, tokenizer, target, draft_device or device,
                                draft_dtype or dtype, progress, export_device=draft_device,
                                export_threads=cpu_draft_threads(dev))
        return cls(model, tokenizer, drafter, dev, name=target, fallback=fallback_for(drafter))

    # -- requests ---------------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids for a prompt; chat messages go through the model's chat template."""
        if isinstance(prompt, str):
            if not prompt:
                raise PromptError("the prompt is empty", "give some text to continue, or chat messages")
            ids = self.tokenizer(prompt)["input_ids"]
        elif len(prompt) and isinstance(prompt[0], dict):
            if getattr(self.tokenizer, "chat_template", None) is None:
                raise PromptError(f"{self.name} has no chat template", "pass a plain string prompt instead")
            ids = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
        else:
            ids = [int(t) for t in prompt]
        ids = list(ids)
        if not ids:
            raise PromptError("the prompt is empty", "give some text to continue, or chat messages")
        limit = self.verifier.max_context
        if len(ids) >= limit:
            raise PromptError(
                f"the prompt is {len(ids)} tokens; {self.name}'s context window is {limit}",
                f"shorten the prompt to under {limit} tokens (leaving room for the reply)",
            )
        return ids

    def generate(self, prompt: Prompt, config: GenerationConfig | None = None,
                 trace: str | None = None) -> GenerationResult:
        """Run one request to completion (trace: see stream)."""
        for event in self.stream(prompt, config, trace):
            if isinstance(event, FinishEvent):
                return event.result
        raise AssertionError("stream ended without a FinishEvent")

    def stream(self, prompt: Prompt, config: GenerationConfig | None = None,
               trace: str | None = None) -> Iterator[Event]:
        """TokenEvents as tokens are committed, then one FinishEvent with the whole result.
        Closing the iterator early cancels the request (the draft worker, if any, is stopped).
        trace: a file to write the request's draft/verify timeline to, in Chrome's trace format."""
        self._check_open()
        cfg = config or GenerationConfig()
        if not isinstance(cfg, GenerationConfig):
            raise ConfigError(f"config must be a GenerationConfig, got {type(cfg).__name__}", "")
        ids = self.encode(prompt)
        self.pipeline_mode(cfg)  # a bad early_exit_layer is reported now, not mid-stream
        return self._run(ids, cfg, trace)

    def pipeline_mode(self, cfg: GenerationConfig) -> str:
        """The mode `cfg.pipeline` resolves to with this drafter and target (see GenerationConfig)."""
        mode = cfg.pipeline
        if self.drafter is None:
            return "sequential"
        if mode == "auto":  # overlap only where the draft computes beside the target, not on its cores
            apart = not shares_cpu(self.verifier.device, self.drafter)
            mode = "overlap" if hasattr(self.drafter, "propose_iter") and apart else "sequential"
        if mode == "branches" and not (self.verifier.supports_early_exit and cfg.branch_width > 0):
            mode = "overlap"
        if mode == "branches" and cfg.early_exit_layer is not None and cfg.early_exit_layer >= self.verifier.num_layers:
            raise ConfigError(
                f"early_exit_layer {cfg.early_exit_layer} is not inside {self.name}'s "
                f"{self.verifier.num_layers} layers",
                f"pick a layer from 1 to {self.verifier.num_layers - 1}, or None for half the depth")
        return mode

    def _steps(self, ids: list[int], cfg: GenerationConfig, budget: int, timeline: Timeline, mode: str):
        if mode == "sequential":
            return speculative_decode(self.verifier, self.drafter, ids, cfg, budget, timeline, self.fallback)
        return pipelined_decode(self.verifier, self.drafter, ids, cfg, budget, branches=mode == "branches",
                                fallback=self.fallback, timeline=timeline,
                                threads=overlap_threads(self.verifier.device, self.drafter))

    def _run(self, ids: list[int], cfg: GenerationConfig, trace: str | None) -> Iterator[Event]:
        with self._lock:
            self._check_open()
            start = time.perf_counter()
            budget = min(cfg.max_new_tokens, self.verifier.max_context - len(ids))
            mode = self.pipeline_mode(cfg)
            timeline = Timeline()
            recorder = StatsRecorder(len(ids), timeline, mode)
            text = _TextAssembler(self.tokenizer, cfg.stop)
            tokens: list[int] = []
            from_draft: list[bool] = []
            finish = "length"
            steps = self._steps(ids, cfg, budget, timeline, mode)
            try:
                for index, step in enumerate(steps):
                    kept = step.tokens
                    for j, tok in enumerate(step.tokens):
                        if tok in self.eos_ids:
                            kept, finish = step.tokens[: j + 1], "stop"
                            break
                    recorder.add(step, len(kept))
                    stats = recorder.snapshot(time.perf_counter() - start)
                    for j, tok in enumerate(kept):
                        tokens.append(tok)
                        from_draft.append(j < step.n_accepted)
                        delta, stopped = text.push(tok)
                        yield TokenEvent(tok, delta, j < step.n_accepted, index, stats)
                        if stopped:
                            finish = "stop"
                            break
                    if finish == "stop":
                        break
            except GeneratorExit:
                finish = "cancelled"
                raise
            finally:
                steps.close()
                finish_hook = getattr(self.drafter, "finish", None)
                if finish_hook is not None and finish != "cancelled":
                    try:
                        finish_hook(ids, tokens)
                    except Exception as exc:  # learning is best-effort; the reply is already right
                        log.warning("drafter %r could not learn from the request: %s", self.drafter, exc)
            recorder.generated = len(tokens)
            if trace:
                timeline.write_chrome_trace(trace)
            tail = text.flush()
            result = GenerationResult(text.text, tokens, finish, recorder.snapshot(time.perf_counter() - start),
                                      from_draft)
            yield FinishEvent(result, tail)

    # -- lifecycle --------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for a running request to finish (its draft worker thread ends with it), then free the
        KV caches, drop the models (so their device memory can be released) and close the drafters
        (their `close()`, if they have one). Calls after close() raise EngineClosedError; closing
        twice is a no-op."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self.verifier.reset()
            for drafter in (self.drafter, self.fallback):
                lm = getattr(drafter, "lm", None)
                if lm is not None:
                    lm.reset()
                    lm.model = None
                drafter_close = getattr(drafter, "close", None)
                if callable(drafter_close):
                    drafter_close()
            device = self.verifier.device
            self.verifier.model = None
            if device.type == "cuda":
                torch.cuda.empty_cache()

    def _check_open(self) -> None:
        if self.closed:
            raise EngineClosedError(f"this Engine ({self.name}) has been closed",
                                    "load a new Engine, or keep using it inside its `with` block")

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def fallback_for(drafter: Drafter | None) -> Drafter | None:
    """The model-free drafter beside a draft model: n-gram (free to set up; retrieval would first need a
    datastore for this tokenizer). The pipeline lets it serve the steps where its draft, made at once,
    beats waiting for the model's, and every step once the draft model fails; then plain decoding."""
    return NGramDrafter() if hasattr(drafter, "propose_iter") else None


def _make_drafter(draft, target_tokenizer, target_name: str, device, dtype, progress: bool,
                  export_device: str | None = None, export_threads: int | None = None) -> Drafter | None:
    """See Engine.load for the accepted values of `draft`."""
    if draft is None or draft == "none":
        return None
    if not isinstance(draft, str):
        return draft  # a Drafter instance
    if draft == "ngram":
        return NGramDrafter()
    kind, _, where = draft.partition(":")
    if draft == "auto":
        from mirrorsd.runtime.drafters.exported import auto_export_drafter

        exported = auto_export_drafter(target_tokenizer, export_device)
        if exported is not None:
            return exported
    if kind in ("auto", "chain", "retrieval") and (kind != "auto" or not where):
        from mirrorsd.runtime.drafters.retrieval.datastore import Datastore, default_datastore

        store = (Datastore.open(where, target_tokenizer) if where
                 else default_datastore(target_tokenizer, progress=progress, tokenizer_name=target_name))
        retrieval = RetrievalDrafter(store, learn=bool(where))
        return retrieval if kind == "retrieval" else ChainDrafter(NGramDrafter(), retrieval)
    from mirrorsd.export_format import is_export

    if is_export(draft):
        from mirrorsd.runtime.drafters.exported import drafter_from_export

        return drafter_from_export(draft, target_tokenizer, target_name, export_device, export_threads)
    from mirrorsd.devices import parse_dtype, resolve_device
    from mirrorsd.models import load_model

    dev = resolve_device(device)
    model, tokenizer = load_model(draft, dev, parse_dtype(dtype, dev), progress)
    use_onednn_linear(model)
    check_tokenizers_match(target_tokenizer, tokenizer, target_name, draft)
    return TorchDraftModel(TorchCausalLM(model, dev), name=f"torch:{dev.type}")


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    gen_cfg = getattr(model, "generation_config", None)
    eos = getattr(gen_cfg, "eos_token_id", None)
    if eos is not None:
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)


class _TextAssembler:
    """Incremental detokenisation with stop strings: never emits half a UTF-8 character, nor text
    that might turn out to be the start of a stop string."""

    def __init__(self, tokenizer, stops: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0

    def push(self, token: int) -> tuple[str, bool]:
        self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for stop in self.stops:
            at = self.text.find(stop, max(0, self.emitted - len(stop)))
            if at >= 0:
                self.text = self.text[:at]
                return self.flush(), True
        end = len(self.text) - self.hold
        while end > self.emitted and self.text[end - 1] == "\ufffd":  # a character still incomplete
            end -= 1
        if end <= self.emitted:
            return "", False
        delta, self.emitted = self.text[self.emitted:end], end
        return delta, False

    def flush(self) -> str:
        delta, self.emitted = self.text[self.emitted:], len(self.text)
        return delta
