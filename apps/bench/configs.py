"""The configurations `mirrorsd bench` runs side by side: a small registry.

A configuration is a name and a factory: given the loaded models (a BenchContext) it returns a
runner, a function `(prompt_ids, GenerationConfig) -> Output`, or None when it cannot run here (no
draft model given, backend not installed). The first registered configuration, our target-only
decoding, is the reference every greedy output is checked against.

Adding a row (e.g. an exported ONNX draft, or the two-queue pipeline in one of its modes) is a
few lines::

    from mirrorsd.apps.bench.configs import BenchConfig, ours, register

    register(BenchConfig("ONNX draft (ours)", lambda ctx: ours(ctx, make_onnx_drafter(ctx))))

`ours(ctx, drafter, **overrides)` runs our Engine (the loaded target, `Engine.with_drafter`) with
GenerationConfig overrides (the pipeline rows pass pipeline="overlap" / "branches"); it keeps the
request's draft and verify spans (`GenerationResult.spans`), so an overlapped schedule shows as
overlapped in the timeline plot.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Protocol

import torch

from mirrorsd import Engine, GenerationConfig
from mirrorsd.results import FinishEvent, GenerationStats, Span
from mirrorsd.backends import TorchCausalLM
from mirrorsd.drafters import ChainDrafter, ModelDrafter, NGramDrafter, RetrievalDrafter
from mirrorsd.structured import GrammarLogitsProcessor


@dataclass
class Output:
    """What one run of one configuration on one prompt produced."""

    tokens: list[int]
    stats: GenerationStats | None = None  # our runtime's statistics (None for peers)
    token_times: list[float] = field(default_factory=list)  # seconds from start at which each token arrived
    draft_spans: list[Span] = field(default_factory=list)  # the draft lane (the engine's timeline)
    verify_spans: list[Span] = field(default_factory=list)  # the verify lane


Runner = Callable[[list[int], GenerationConfig], Output]


class ServedRunner(Protocol):
    """A Runner backed by a server of its own (a `separate` row): started by `open`, stopped by `close`."""

    def __call__(self, ids: list[int], cfg: GenerationConfig) -> Output: ...

    def open(self) -> None: ...

    def fresh(self) -> None:
        """Before each measured request, outside its timing: drop whatever the server kept from the requests
        before (a repeat must not draft the previous repeat's answer)."""

    def close(self) -> None: ...


@dataclass
class BenchContext:
    """The models every configuration shares (loaded once per bench run, on first use)."""

    engine: Engine  # the target on the torch backend (float32 reference); drafters are set per configuration
    target_name: str
    draft_lm: torch.nn.Module | None = None  # the independent draft model, if one was given
    draft_name: str | None = None
    datastore_spec: object = "default"  # "default" (stdlib), a Datastore, a path, or None (no retrieval rows)
    draft_export: str | None = None  # an export folder (`mirrorsd export`) for the exported-draft rows
    target_export: str | None = None  # a `mirrorsd export --role target` folder of the target: ONNX rows
    memory_mb: dict[str, float] = field(default_factory=dict)  # resident memory each model added when loaded
    draft_threads: int | None = None  # llama.cpp threads of the GGUF draft (1 under --pin-devices; None: all)
    k: int = 8  # the bench's --k: the start value of our K, and the K peers speculate with

    @cached_property
    def cpp_engine(self) -> Engine | None:
        """The same target's GGUF file on the llama.cpp backend, where llama-cpp-python is installed."""
        from mirrorsd.models import is_gguf
        from mirrorsd.backends import llamacpp_installed

        if not (llamacpp_installed() and is_gguf(self.target_name)):
            return None
        with measure_memory(self.memory_mb, "target (llama.cpp)"):
            engine = Engine.load(self.target_name, backend="llamacpp", draft="none", progress=True)
            engine.target.score([0, 1, 2])  # touch every weight page (mmap) before measuring
            engine.target.reset()
        return engine

    @cached_property
    def onnx_engine(self) -> Engine | None:
        """The target's export on the onnx backend (ONNX Runtime), where one was given."""
        if self.target_export is None:
            return None
        from mirrorsd.export_format import check_tokenizer, read_manifest

        with measure_memory(self.memory_mb, "target (onnx)"):
            engine = Engine.load(self.target_export, backend="onnx", draft="none", progress=True)
            engine.target.score([0, 1, 2])
            engine.target.reset()
        if self.engine is not None or self.cpp_engine is not None:  # its ids must mean the same text
            check_tokenizer(read_manifest(self.target_export), self.tokenizer, self.target_name, self.target_export)
        return engine

    @property
    def any_engine(self) -> Engine | None:
        """A loaded target (any backend), for what does not depend on the backend (tokenizer, encoding)."""
        if self.engine is not None:
            return self.engine
        from mirrorsd.models import is_gguf

        return self.cpp_engine if is_gguf(self.target_name) and self.cpp_engine is not None else self.onnx_engine

    @cached_property
    def cpp_draft_lm(self):
        """The draft model's GGUF file on llama.cpp, for the llama.cpp draft-model rows."""
        from mirrorsd.models import is_gguf
        from mirrorsd.backends import llamacpp_installed, load_lm

        if self.draft_name is None or not llamacpp_installed() or not is_gguf(self.draft_name):
            return None
        with measure_memory(self.memory_mb, "draft (llama.cpp)"):
            if self.draft_threads is None:
                lm = load_lm(self.draft_name, "llamacpp", progress=True).lm
            else:  # pinned to one core: one compute thread
                from mirrorsd.models import resolve_gguf
                from mirrorsd.backends import LlamaCppLM

                lm = LlamaCppLM(resolve_gguf(self.draft_name, True)[0], threads=self.draft_threads, gpu_layers=0)
            lm.score([0, 1, 2])
            lm.reset()
        return lm

    @property
    def model(self):
        return self.engine.target.model

    @property
    def tokenizer(self):
        return (self.engine or self.cpp_engine or self.onnx_engine).tokenizer

    @cached_property
    def export_drafter(self):
        """The exported draft on the backend the placement policy picks for it (ONNX Runtime's CPU provider
        on a machine without an NPU, Core ML for a Core ML export on a Mac), one instance shared by its
        rows, with the thread split the engine gives a CPU-provider export beside a CPU target."""
        from mirrorsd.bench import cpu_draft_threads
        from mirrorsd.drafters import drafter_from_export

        if self.draft_export is None:
            return None
        with measure_memory(self.memory_mb, "draft export"):
            return drafter_from_export(self.draft_export, self.tokenizer, self.target_name, None,
                                       cpu_draft_threads(self.any_engine.target.computes_on))

    @cached_property
    def datastore(self):
        from mirrorsd.drafters import Datastore, default_datastore

        spec = self.datastore_spec
        if spec is None or isinstance(spec, Datastore):
            return spec
        if spec == "default":
            return default_datastore(self.tokenizer, progress=True, tokenizer_name=self.target_name)
        return Datastore.open(spec, self.tokenizer)


TARGET_ONLY = "target only (ours)"
CPP_TARGET_ONLY = "target only, llama.cpp (ours)"


@dataclass(frozen=True)
class BenchConfig:
    name: str
    make: Callable[[BenchContext], Runner | None]
    peer_of: str | None = None  # for a peer (transformers, llama.cpp): the row of ours it is compared with
    needs: str = ""  # what `make` needs when it returns None, for the report ("a draft model", ...)
    reference: str = TARGET_ONLY  # target-only decoding on the same backend: greedy outputs must equal its
    # own, and speedups are over it
    memory: tuple[str, ...] = ("target",)  # the models it runs (keys of BenchContext.memory_mb)
    own_grammar: bool = False  # constrains structured output with another grammar engine (another JSON layout):
    # its structured replies are timed, not token-compared
    equal_to: str | None = None  # the row whose greedy tokens this one's must equal (None: `reference`;
    # its own name: none, it is itself a reference)
    group: str | None = None  # a peer group that runs only when asked for (`bench --peers GROUP`)
    separate: bool = False  # its runner is a ServedRunner (a server of its own): measured as a block, alone,
    # after the interleaved rows
    seeded_equal: bool = False  # its seeded sampled replies must equal its reference's too: target-only itself,
    # and our model-free rows (one-hot drafts are checked against target-only's own draws)

    @property
    def greedy_reference(self) -> str | None:
        target = self.equal_to or self.reference
        return None if target == self.name and self.equal_to else target

    @property
    def ours(self) -> bool:
        return self.peer_of is None


CONFIGS: list[BenchConfig] = []


def register(config: BenchConfig, after: str | None = None) -> BenchConfig:
    """Add a configuration (replacing one of the same name), at the end or right after `after`."""
    existing = [c.name for c in CONFIGS]
    if config.name in existing:
        CONFIGS[existing.index(config.name)] = config
        return config
    CONFIGS.insert(existing.index(after) + 1 if after in existing else len(CONFIGS), config)
    return config


def ours(ctx: BenchContext, drafter, engine: Engine | None = None, **config: object) -> Runner:
    """A runner for our runtime (`engine`, default the torch target) with `drafter` (None: target-only)
    and GenerationConfig overrides (e.g. pipeline="overlap"), timing every token; the draft/verify spans
    are the request's own (GenerationResult.spans), so overlapped work shows as overlapped. Every run
    starts from cold KV caches: rows share loaded models, and a cache left by the row before on the same
    prompt would let a run skip its prompt prefill."""
    base = engine or ctx.engine

    def run(ids: list[int], cfg: GenerationConfig) -> Output:
        engine = base.with_drafter(drafter)  # paired with a helper as Engine.load pairs them
        engine.reset()
        out = Output([])
        start = time.perf_counter()
        for event in engine.stream(ids, replace(cfg, **config)):
            if isinstance(event, FinishEvent):
                out.stats = event.result.stats
                out.draft_spans = [s for s in event.result.spans if s.lane == "draft"]
                out.verify_spans = [s for s in event.result.spans if s.lane == "verify"]
                break
            out.tokens.append(event.token_id)
            out.token_times.append(time.perf_counter() - start)
        return out

    return run


def resident_mb() -> float:
    """This process's resident memory (Linux /proc; 0 where it cannot be read)."""
    try:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


@contextmanager
def measure_memory(into: dict[str, float], key: str):
    """Record how much resident memory loading a model added (weights, caches, runtime buffers)."""
    before = resident_mb()
    yield
    into[key] = round(resident_mb() - before, 1)


class _TokenClock:
    """A transformers streamer that timestamps the tokens `generate` emits (the first put is the prompt)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.extend([time.perf_counter() - self.start] * int(value.numel()))

    def end(self) -> None:
        pass


def transformers_generate(ctx: BenchContext, **kw) -> Runner:
    """A runner for transformers' own `generate` on the same model object (kw: prompt lookup, assistant)."""
    from transformers.generation.streamers import BaseStreamer

    clock_cls = type("TokenClock", (_TokenClock, BaseStreamer), {})
    tok = ctx.tokenizer

    def run(ids: list[int], cfg: GenerationConfig) -> Output:
        x = torch.tensor([ids], device=ctx.engine.target.device)
        sampling = dict(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p) if cfg.temperature > 0 else \
            dict(do_sample=False)
        clock = clock_cls()
        if cfg.structured:  # the same grammar, through transformers' logits-processor hook
            sampling["logits_processor"] = [GrammarLogitsProcessor(ctx.engine.constraint(cfg), len(ids))]
        with torch.inference_mode():
            y = ctx.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=cfg.max_new_tokens,
                                   pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                                   streamer=clock, **sampling, **kw)
        tokens = y[0, len(ids):].tolist()
        return Output(tokens, None, clock.times[: len(tokens)])

    return run


def _draft_model(ctx: BenchContext) -> ModelDrafter | None:
    return ModelDrafter(TorchCausalLM(ctx.draft_lm)) if ctx.draft_lm is not None else None


def _with_store(make):
    return lambda ctx, *engine: None if ctx.datastore is None else make(ctx, *engine)


_STORE, _DRAFT = "a retrieval datastore", "a draft model (--draft-model)"
_EXPORT = "an exported draft (--draft-export DIR, made by `mirrorsd export`)"

register(BenchConfig(TARGET_ONLY, lambda ctx: ours(ctx, None), seeded_equal=True))
register(BenchConfig("transformers generate", lambda ctx: transformers_generate(ctx), peer_of=TARGET_ONLY))
register(BenchConfig("n-gram (ours)", lambda ctx: ours(ctx, NGramDrafter()), seeded_equal=True))
register(BenchConfig("prompt lookup (transformers)", lambda ctx: transformers_generate(ctx, prompt_lookup_num_tokens=10),
                     peer_of="n-gram (ours)"))
register(BenchConfig("retrieval (ours)",
                     _with_store(lambda ctx: ours(ctx, RetrievalDrafter(ctx.datastore))), needs=_STORE,
                     seeded_equal=True))
register(BenchConfig("chain n-gram + retrieval (ours)",
                     _with_store(lambda ctx: ours(ctx, ChainDrafter(NGramDrafter(), RetrievalDrafter(ctx.datastore)))),
                     needs=_STORE, seeded_equal=True))
def _row(what: str, mode: str) -> str:
    """A draft row's name: the pipeline mode after the draft, none when the pipeline is off."""
    return f"{what} (ours)" if mode == "off" else f"{what}, {mode} (ours)"


for _mode in ("off", "overlap", "branches"):  # the two-queue pipeline: one row per schedule
    register(BenchConfig(_row("draft model", _mode),
                         lambda ctx, mode=_mode: ours(ctx, _draft_model(ctx), pipeline=mode) if ctx.draft_lm is not None
                         else None, needs=_DRAFT, memory=("target", "draft")))
register(BenchConfig("draft model, branches from early exit (ours)",  # the target's layer-l_e candidates
                     lambda ctx: ours(ctx, _draft_model(ctx), pipeline="branches", branch_source="early_exit")
                     if ctx.draft_lm is not None else None, needs=_DRAFT, memory=("target", "draft")))
for _mode in ("off", "overlap", "branches"):  # the same draft exported, on ONNX Runtime
    register(BenchConfig(_row("exported draft", _mode),
                         lambda ctx, mode=_mode: ours(ctx, ctx.export_drafter, pipeline=mode)
                         if ctx.draft_export is not None else None, needs=_EXPORT, memory=("target", "draft export")))
for _mode in ("off", "overlap", "branches"):  # the GGUF draft on llama.cpp beside the torch target
    register(BenchConfig(_row("GGUF draft on llama.cpp", _mode),
                         lambda ctx, mode=_mode: ours(ctx, ModelDrafter(ctx.cpp_draft_lm), pipeline=mode)
                         if ctx.cpp_draft_lm is not None else None, needs="a GGUF draft model and llama-cpp-python",
                         memory=("target", "draft (llama.cpp)")))
PINNED = [TARGET_ONLY] + [_row(row, mode) for row in ("draft model", "exported draft", "GGUF draft on llama.cpp")
                          for mode in ("off", "overlap", "branches")]
"""The rows of `bench --pin-devices`: target-only and each draft in every pipeline mode, all on the torch
target, the verify side pinned to one core and the draft side to another (separate compute, simulated)."""
register(BenchConfig("assisted generation (transformers)",
                     lambda ctx: transformers_generate(ctx, assistant_model=ctx.draft_lm) if ctx.draft_lm is not None
                     else None, peer_of="draft model (ours)", needs=_DRAFT))


# -- llama.cpp: the target's GGUF file as it is; greedy outputs are compared with llama.cpp's own target-only
# decoding, token for token (the backend's batch-invariant kernels make verify passes exact).

def llama_cpp_generate(ctx: BenchContext, prompt_lookup: bool = False) -> Runner | None:
    """llama-cpp-python's own generation on the same GGUF file (its prompt-lookup drafting with
    prompt_lookup=True): the peer a laptop user would pick instead."""
    if ctx.cpp_engine is None:
        return None
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from mirrorsd.bench import physical_cores
    from mirrorsd.bench import stock_kernels

    lm = ctx.cpp_engine.target
    if prompt_lookup:  # a draft model makes llama-cpp-python keep logits for every position: its own context
        threads = physical_cores()
        llm = Llama(model_path=str(lm.path), n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                    n_gpu_layers=-1 if lm.computes_on == "gpu" else 0, verbose=False,
                    draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))
    else:
        # The very Llama our backend decodes with: two loads of one GGUF in a process decode at different
        # speeds (docs/measurements.md: memory placement), so only the same object compares the loops alone.
        llm = lm.llm
    eos = ctx.cpp_engine.eos_ids
    # A cold cache, as our rows start (generate() would reuse the prefix of the last request); on the shared
    # Llama through our backend, so its bookkeeping empties with the context's cache (and again after).
    reset = llm.reset if prompt_lookup else lm.reset

    def run(ids: list[int], cfg: GenerationConfig) -> Output:
        with stock_kernels():  # llama.cpp's own batched kernels, as llama-cpp-python runs them
            return generate(ids, cfg)

    def generate(ids: list[int], cfg: GenerationConfig) -> Output:
        reset()
        out, start = Output([]), time.perf_counter()
        sampling = dict(temp=cfg.temperature, top_p=cfg.top_p, top_k=0, min_p=0.0) if cfg.temperature > 0 else \
            dict(temp=0.0)
        if cfg.json_schema is not None:  # llama.cpp's own grammar engine (GBNF from the schema)
            from llama_cpp import LlamaGrammar

            sampling["grammar"] = LlamaGrammar.from_json_schema(cfg.json_schema, verbose=False)
        for token in llm.generate(ids, reset=True, repeat_penalty=1.0, **sampling):
            out.tokens.append(int(token))
            out.token_times.append(time.perf_counter() - start)
            if len(out.tokens) >= cfg.max_new_tokens or token in eos:
                break
        if not prompt_lookup:
            lm.reset()
        return out

    return run


def _on(engine_of: Callable[[BenchContext], Engine | None], make):
    """A factory that needs the engine `engine_of` gives (None where it is not loaded: the row is skipped)."""
    return lambda ctx: None if engine_of(ctx) is None else make(ctx, engine_of(ctx))


def _model_free_rows(backend: str, engine_of, row: dict) -> None:
    """Our n-gram and chain rows on one backend's target."""
    register(BenchConfig(f"n-gram, {backend} (ours)", _on(engine_of, lambda ctx, e: ours(ctx, NGramDrafter(), engine=e)),
                         seeded_equal=True, **row))
    register(BenchConfig(f"chain n-gram + retrieval, {backend} (ours)",
                         _on(engine_of, _with_store(lambda ctx, e: ours(
                             ctx, ChainDrafter(NGramDrafter(), RetrievalDrafter(ctx.datastore)), engine=e))),
                         seeded_equal=True, **row))


def _cpp(ctx: BenchContext) -> Engine | None:
    return ctx.cpp_engine


_CPP = "llama-cpp-python (pip install 'mirrorsd[llamacpp]') and a GGUF target (every catalog model)"
_CPP_DRAFT = "llama-cpp-python and a GGUF draft model (--draft-model, a catalog name or .gguf)"
_CPP_ROW = dict(reference=CPP_TARGET_ONLY, needs=_CPP, memory=("target (llama.cpp)",))

register(BenchConfig(CPP_TARGET_ONLY, _on(_cpp, lambda ctx, e: ours(ctx, None, engine=e)), seeded_equal=True,
                     **_CPP_ROW))
# llama-cpp-python runs llama.cpp's stock batched kernels, whose prompt prefill differs from one-token decoding:
# its rows are checked against its own plain generation, not against ours.
_PEER = "llama-cpp-python generate"
register(BenchConfig(_PEER, llama_cpp_generate, peer_of=CPP_TARGET_ONLY, own_grammar=True, equal_to=_PEER, **_CPP_ROW))
_model_free_rows("llama.cpp", _cpp, _CPP_ROW)
register(BenchConfig("prompt lookup (llama-cpp-python)", lambda ctx: llama_cpp_generate(ctx, prompt_lookup=True),
                     peer_of="n-gram, llama.cpp (ours)", own_grammar=True, equal_to=_PEER, **_CPP_ROW),
         after="n-gram, llama.cpp (ours)")
register(BenchConfig("draft model, llama.cpp (ours)",
                     lambda ctx: None if ctx.cpp_draft_lm is None else
                     ours(ctx, ModelDrafter(ctx.cpp_draft_lm), engine=ctx.cpp_engine),
                     reference=CPP_TARGET_ONLY, needs=_CPP_DRAFT, memory=("target (llama.cpp)", "draft (llama.cpp)")))
register(BenchConfig("exported draft, llama.cpp (ours)",
                     _on(_cpp, lambda ctx, e: None if ctx.draft_export is None else ours(ctx, ctx.export_drafter, engine=e)),
                     reference=CPP_TARGET_ONLY, needs=f"{_CPP} and {_EXPORT}",
                     memory=("target (llama.cpp)", "draft export")))


# -- the target on ONNX Runtime: its `mirrorsd export --role target` folder.

def _onnx(ctx: BenchContext) -> Engine | None:
    return ctx.onnx_engine


ONNX_TARGET_ONLY = "target only, ONNX Runtime (ours)"
_ONNX = "a target export (--target-export DIR, made by `mirrorsd export --role target`)"
_ONNX_ROW = dict(reference=ONNX_TARGET_ONLY, needs=_ONNX, memory=("target (onnx)",))

register(BenchConfig(ONNX_TARGET_ONLY, _on(_onnx, lambda ctx, e: ours(ctx, None, engine=e)), seeded_equal=True,
                     **_ONNX_ROW))
_model_free_rows("ONNX Runtime", _onnx, _ONNX_ROW)
register(BenchConfig("exported draft, ONNX Runtime (ours)",
                     _on(_onnx, lambda ctx, e: None if ctx.draft_export is None else ours(ctx, ctx.export_drafter, engine=e)),
                     reference=ONNX_TARGET_ONLY, needs=f"{_ONNX} and {_EXPORT}", memory=("target (onnx)", "draft export")))
register(BenchConfig("draft model llama.cpp, ONNX Runtime (ours)",
                     _on(_onnx, lambda ctx, e: None if ctx.cpp_draft_lm is None else
                         ours(ctx, ModelDrafter(ctx.cpp_draft_lm), engine=e)),
                     reference=ONNX_TARGET_ONLY, needs=f"{_ONNX} and {_CPP_DRAFT}",
                     memory=("target (onnx)", "draft (llama.cpp)")))
