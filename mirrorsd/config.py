"""Settings of one request.

Two parts, kept apart as vLLM keeps SamplingParams apart from its speculative config:
- SamplingParams: how the next token is chosen from the target's logits. `verify` and the logit
  processing (mirrorsd.runtime.decode.sampling) see only this; output depends only on it (and the models).
- SpeculativeConfig: how drafting and verification are scheduled. It changes speed, never output.
GenerationConfig is what callers pass: the request's length and stop strings plus every field of both
parts, flat; `.sampling` and `.speculative` are the parts, validated at construction.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from dataclasses import dataclass, field, fields

from mirrorsd.errors import ConfigError

PIPELINE_MODES = ("auto", "off", "overlap", "branches")
PIPELINE_ALIASES = {"sequential": "off"}  # earlier spellings, still accepted
MAX_DRAFT_TOKENS = 256  # longer drafts than any verify pass pays for; a larger value is a mistake
BRANCH_SOURCES = ("auto", "early_exit", "draft")



def is_text(text: str) -> bool:
    """Whether a str encodes as UTF-8: no lone surrogates (as undecodable bytes in argv or JSON become)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_PLAIN_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def is_plain_file_name(name) -> bool:
    """Whether a name read from a file on disk (a datastore segment, an export's graph) is a plain file name:
    joined to its folder it stays inside it (no separator, no '..', no leading dot, nothing but [A-Za-z0-9._-])."""
    return isinstance(name, str) and _PLAIN_FILE_NAME.fullmatch(name) is not None and ".." not in name

@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen; target-only decoding and `verify` apply exactly the same."""

    temperature: float = 0.0
    """0 means greedy (argmax; output token-identical to target-only greedy decoding). > 0 samples,
    and speculative sampling then reproduces the target's distribution exactly."""

    top_k: int = 0
    """Keep only the k likeliest tokens before sampling (0 = off). Applied to target and draft alike."""

    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1.0 = off)."""

    min_p: float = 0.0
    """Keep only tokens at least min_p times as likely as the likeliest one, after temperature, top-k and
    top-p, as transformers' MinPLogitsWarper does (0.0 = off)."""

    repetition_penalty: float = 1.0
    """CTRL-style penalty (>1 discourages tokens already in the context), as in transformers. Applies
    to greedy decoding too."""

    presence_penalty: float = 0.0
    """OpenAI's: subtracted from the logit of every token already generated in this reply (-2..2)."""

    frequency_penalty: float = 0.0
    """OpenAI's: subtracted once per earlier occurrence in this reply (-2..2). Both count the generated
    tokens only, as vLLM does, and apply to greedy decoding too."""

    seed: int | None = None
    """Seed for the sampling random stream. Same seed, same config, same models: same output."""

    def __post_init__(self) -> None:
        check_types(self)
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed must be a non-negative integer, got {self.seed}", "e.g. seed=0, or None")
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise ConfigError(
                f"temperature must be >= 0, got {self.temperature!r}",
                "use 0 for greedy decoding or a positive value such as 0.7 for sampling",
            )
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}", "use 0 to turn top-k off")
        if not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}", "use 1.0 to turn top-p off")
        if not (0.0 <= self.min_p <= 1.0):
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p}", "use 0.0 to turn min-p off")
        if not (self.repetition_penalty > 0.0):
            raise ConfigError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}", "use 1.0 for no penalty"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ConfigError(f"{name} must be in [-2, 2], got {getattr(self, name)}", "use 0 for no penalty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafting and verification are scheduled."""

    num_draft_tokens: int = 8
    """K (gamma): draft tokens proposed per verify step; the starting value when adaptive_k is on."""

    adaptive_k: bool = True
    """Choose K per step within [1, max_draft_tokens] from measured costs: the K that maximises
    Leviathan's predicted speedup for the running acceptance estimate and the measured ratio of draft
    time per token to verify time (runtime/decode/policy/schedule.py). Seeded sampling uses transformers'
    heuristic instead (all accepted: K += 2, else K -= 1), since a timing-based K would make the seed's
    random stream depend on the machine's speed. False: K stays at num_draft_tokens."""

    max_draft_tokens: int = 16
    """Upper bound on K, whatever the schedule says."""

    pipeline: str = "auto"
    """How drafting and verification are scheduled:
    "off": no pipeline: draft, then verify, on one thread (runtime/decode/loop.py, InlineProvider; the
    earlier spelling "sequential" is accepted);
    "overlap": a draft worker thread drafts step t+1 while the target verifies step t, assuming step t
    is fully accepted (runtime/decode/pipeline/provider.py);
    "branches": overlap plus Mirror-SD early exit: the verify pass publishes its layer-l_e top-kappa
    tokens and the draft worker prepares the likeliest correction branches (targets whose backend
    declares early exit; others run as "overlap");
    "auto": for a draft model, the faster of "off" and "overlap" as a one-time calibration on the
    request's placement measures them (runtime/decode/policy/calibrate.py: a K-token verify pass and a draft token,
    alone and side by side); "off" for model-free drafters (they draft in microseconds: nothing to
    hide; so does a model-free drafter in a seeded request, whatever the mode, so that the seed gives one output).
    Output is identical in every mode."""

    early_exit_layer: int | None = None
    """l_e: the target layer whose output is read through the LM head for branch hints (1-based;
    None = 4/5 of the depth: earlier layers of qwen2.5-coder-1.5b rarely knew the correction,
    docs/branch-coverage.md)."""

    branch_width: int = 3
    """kappa: branch candidates considered per draft position (0 turns branches off)."""

    branch_source: str = "auto"
    """Where "branches" mode takes its candidates (rejection point, correction) from:
    "early_exit": the target's layer-l_e top-kappa, read midway through each verify pass (backends that
    declare early exit);
    "draft": the draft model's own top kappa + 1 choices at each drafted position (its first choice is, when
    greedy, the drafted token itself), known before the pass starts: the whole pass is left for drafting
    branches and the target computes nothing extra (draft models that declare a ranking, e.g.
    ModelDrafter);
    "auto": "draft" where the drafter can rank, else "early_exit" (docs/branch-coverage.md: on
    qwen2.5-coder-1.5b with the 0.5b draft, the draft's 3 alternatives held the correction of 94% of
    rejections, the early exit's top-3 none at half depth and 55% at layer 22 of 28).
    Without either, "branches" runs as "overlap"."""

    draft_timeout_s: float = 30.0
    """A pipelined drafter that has not produced a draft this long after it was due is dropped for
    the rest of the request (the model-free helper serves on); output is unchanged."""

    def __post_init__(self) -> None:
        check_types(self)
        if not (1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS and 1 <= self.max_draft_tokens <= MAX_DRAFT_TOKENS):
            raise ConfigError(
                f"num_draft_tokens and max_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], got "
                f"{self.num_draft_tokens} and {self.max_draft_tokens}",
                "typical values are 4-16; to decode without drafting, load the engine with draft='none'",
            )
        object.__setattr__(self, "pipeline", PIPELINE_ALIASES.get(self.pipeline, self.pipeline))
        if self.pipeline not in PIPELINE_MODES:
            raise ConfigError(f"pipeline must be one of {', '.join(PIPELINE_MODES)}, got {self.pipeline!r}",
                              "use auto unless you are comparing modes")
        if self.branch_source not in BRANCH_SOURCES:
            raise ConfigError(f"branch_source must be one of {', '.join(BRANCH_SOURCES)}, got {self.branch_source!r}",
                              "auto uses the draft model's candidates where it can rank, else early exit")
        if self.branch_width < 0 or (self.early_exit_layer is not None and self.early_exit_layer < 1):
            raise ConfigError(
                f"branch_width must be >= 0 and early_exit_layer >= 1, got {self.branch_width} and "
                f"{self.early_exit_layer}", "early_exit_layer=None picks 4/5 of the target's depth")
        if not (self.draft_timeout_s > 0):
            raise ConfigError(f"draft_timeout_s must be > 0, got {self.draft_timeout_s}", "the default is 30 s")


@dataclass(frozen=True)
class GenerationConfig:
    """Settings for one generate/stream call (fields of SamplingParams and SpeculativeConfig are
    documented there). Defaults give greedy decoding with adaptive K."""

    max_new_tokens: int = 256
    """Most tokens to generate. Generation also stops at EOS, at a stop string, or at the context limit."""

    # The two parts' fields, flat; each default is declared once, in its part.
    temperature: float = SamplingParams.temperature
    top_k: int = SamplingParams.top_k
    top_p: float = SamplingParams.top_p
    min_p: float = SamplingParams.min_p
    repetition_penalty: float = SamplingParams.repetition_penalty
    presence_penalty: float = SamplingParams.presence_penalty
    frequency_penalty: float = SamplingParams.frequency_penalty
    seed: int | None = SamplingParams.seed

    stop: tuple[str, ...] = ()
    """Stop strings: generation ends when the text contains one; it is not included in the result. A single
    string is one stop string (`stop="\n\n"`), as in OpenAI's API."""

    json_schema: str | dict | None = None
    """Structured output: the reply is JSON valid against this schema (a dict or its JSON text;
    {"type": "object"} for any JSON object). At most one of json_schema, regex and grammar is set. The
    target's distribution is masked by the grammar in verification and drafts stop at a forbidden token, so
    output is exactly constrained target-only decoding's (mirrorsd/structured.py)."""
    regex: str | None = None
    """Structured output: the reply matches this regular expression."""
    grammar: str | None = None
    """Structured output: the reply follows this Lark grammar (llguidance's dialect)."""

    logprobs: int | None = None
    """Return the target's log-probability of each generated token and of its `logprobs` likeliest
    alternatives (0: the chosen token's only; None: off). At most 20, as OpenAI's API."""

    num_draft_tokens: int = SpeculativeConfig.num_draft_tokens
    adaptive_k: bool = SpeculativeConfig.adaptive_k
    max_draft_tokens: int = SpeculativeConfig.max_draft_tokens
    pipeline: str = SpeculativeConfig.pipeline
    early_exit_layer: int | None = SpeculativeConfig.early_exit_layer
    branch_width: int = SpeculativeConfig.branch_width
    branch_source: str = SpeculativeConfig.branch_source
    draft_timeout_s: float = SpeculativeConfig.draft_timeout_s

    sampling: SamplingParams = field(init=False, repr=False, compare=False)
    speculative: SpeculativeConfig = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_types(self)
        if self.max_new_tokens < 1:
            raise ConfigError(
                f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}",
                "ask for at least one new token, e.g. max_new_tokens=128",
            )
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ConfigError(f"stop must be a non-empty string or a list of them, got {self.stop!r}",
                              'e.g. stop=["\\n\\n"]')
        if not all(is_text(s) for s in stop):
            raise ConfigError("a stop string is not valid Unicode text (it holds a lone surrogate)",
                              "send stop strings as UTF-8 text")
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "pipeline", PIPELINE_ALIASES.get(self.pipeline, self.pipeline))
        self._check_structure()
        object.__setattr__(self, "sampling", _part(SamplingParams, self))
        object.__setattr__(self, "speculative", _part(SpeculativeConfig, self))

    @property
    def greedy(self) -> bool:
        return self.sampling.greedy

    @property
    def reproducible(self) -> bool:
        """Seeded sampling: the seed's random stream must give the same tokens on any machine, so where a model's
        drafts spend it by draft, nothing that consumes it (which drafter serves a step, the draft length, the
        gate) may depend on timing (policy/schedule.py `timing_free`). Greedy and unseeded runs, and seeded runs
        with a model-free drafter, may adapt to measured speed freely (output is unchanged either way)."""
        return not self.greedy and self.seed is not None

    @property
    def structured(self) -> bool:
        return (self.json_schema, self.regex, self.grammar) != (None, None, None)

    def _check_structure(self) -> None:
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", canonical_schema(self.json_schema))
        chosen = [name for name in ("json_schema", "regex", "grammar") if getattr(self, name) is not None]
        if len(chosen) > 1:
            raise ConfigError(f"set at most one of json_schema, regex and grammar, got {' and '.join(chosen)}",
                              "a JSON schema, a regex or a Lark grammar describes the whole reply")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ConfigError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}",
                              "0 returns the chosen tokens' log-probabilities only; None turns them off")


MAX_TOP_LOGPROBS = 20
SCHEMA_HINT = 'e.g. json_schema={"type": "object", "properties": {"name": {"type": "string"}}}'


def canonical_schema(schema) -> str:
    """A JSON schema as canonical text (from a dict, or a string holding a JSON object); ConfigError otherwise."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"json_schema is not valid JSON: {exc}", SCHEMA_HINT) from None
    if not isinstance(schema, dict):
        raise ConfigError(f"json_schema must be a JSON object (a dict), got {type(schema).__name__}", SCHEMA_HINT)
    return json.dumps(schema)

_KINDS = {"int": (numbers.Integral, "an integer"), "float": (numbers.Real, "a finite number"),
          "bool": (bool, "true or false"), "str": (str, "a string")}


def check_types(config) -> None:
    """Every scalar field holds its declared type (no bool for a number, no float for an integer, no
    NaN or infinity): a wrong type is a ConfigError at construction, not a TypeError mid-generation."""
    for f in fields(config):
        if not f.init:
            continue
        value, declared = getattr(config, f.name), str(f.type)
        optional = declared.endswith(" | None")
        kind = _KINDS.get(declared.removesuffix(" | None"))
        if kind is None or (value is None and optional):
            continue
        ok = isinstance(value, kind[0]) and (declared == "bool" or not isinstance(value, bool))
        if ok and kind[0] is numbers.Real:
            ok = math.isfinite(value)
        if not ok:
            raise ConfigError(f"{f.name} must be {kind[1]}{' or None' if optional else ''}, got {value!r}",
                              f"e.g. {f.name}={f.default!r}")


def _part(cls: type, config: GenerationConfig):
    return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})
