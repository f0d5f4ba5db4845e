"""What generate/stream hand back: typed events, the final result and its statistics."""

from __future__ import annotations

from collections import Counter
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import TYPE_CHECKING

from mirrorsd._deprecated import renamed

if TYPE_CHECKING:
    from mirrorsd.contracts import TokenLogprob


_CHAIN = object()  # the key a chain's members are counted under together (no source can be named so)


def add_drafter_tokens(totals: dict[str, tuple[int, int]], source: str, drafted: int, accepted: int) -> None:
    """Count `drafted` / `accepted` tokens to `source` in a source -> (drafted, accepted) record."""
    td, ta = totals.get(source, (0, 0))
    totals[source] = (td + drafted, ta + accepted)


def acceptance_by_source(drafter_tokens: dict[str, tuple[int, int]]) -> dict[str, float]:
    """source -> (drafted, accepted) tokens as source -> accepted / drafted, for the sources that drafted."""
    return {source: round(a / d, 3) for source, (d, a) in sorted(drafter_tokens.items()) if d}


@dataclass(frozen=True)
class GenerationStats:
    """Speculation statistics of one request (a snapshot; events carry the running one)."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of those, the ones the target's KV cache held from the request before
    generated_tokens: int = 0
    verify_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    draft_time_s: float = 0.0  # the draft worker's busy time (with the pipeline off: time spent in propose)
    verify_time_s: float = 0.0  # the target's busy time: verify passes, prompt prefill included
    draft_hidden_s: float = 0.0  # drafting time that overlapped a verify pass (pipeline modes)
    total_time_s: float = 0.0
    time_to_first_token_s: float = 0.0  # from the request's start to its first committed token
    prompt_time_s: float = 0.0  # the first verify pass: the prompt's prefill (what the cache lacked) and its logits
    per_position_drafted: tuple[int, ...] = ()
    per_position_accepted: tuple[int, ...] = ()
    drafters: dict[str, int] = field(default_factory=dict)  # source -> verify steps it served ("none": plain)
    drafter_tokens: dict[str, tuple[int, int]] = field(default_factory=dict)  # source -> (drafted, accepted) tokens
    chain: tuple[str, ...] = ()  # the members' sources when the engine drafts with a chain (they share its steps)
    fallbacks: tuple[str, ...] = ()  # drafters dropped during the request, with the reason
    pipeline: str = "off"  # the mode that ran: off, overlap or branches
    backend: str = ""  # the target's model backend and device: "torch:cpu", "llamacpp:cpu", "llamacpp:gpu", ...
    exact: bool = True  # the target's verify passes are batch-invariant (CausalLM.exact_batches): drafts
    # change no token; False: speculation ran on an inexact backend (allow_inexact or an explicit drafter)
    branch_hits: int = 0  # steps that left the lookahead and landed on a prepared early-exit branch
    branch_misses: int = 0  # steps that left the lookahead with branches prepared, none of them right
    branch_source: str = ""  # where "branches" took its candidates: "early_exit" or "draft" ("" if nowhere)
    hinted_steps: int = 0  # steps whose branch candidates reached the draft worker
    hinted_rejections: int = 0  # of those, steps where a drafted token was rejected
    hinted_covered: int = 0  # of those rejections, the ones whose correction was among the candidates
    branches_planned: int = 0  # branches the draft worker planned, over hinted steps whose plan arrived in time
    branches_ready: int = 0  # of those, drafted to their planned length when the target reconciled
    branch_plans_late: int = 0  # hinted steps whose plan had not reached the target when it reconciled
    branch_states: dict[str, int] = field(default_factory=dict)  # hinted rejections by the state of the
    # branch for their actual outcome at reconcile: ready, drafting, queued (planned, not started), none
    verify_curve: tuple[float, ...] = ()  # the target's measured pass cost for K drafted tokens, in decode
    # steps (index K; runtime/decode/policy/verify_curve.py); () where it was not measured

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of wall time, prompt processing included."""
        return self.generated_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens (alpha as measured); None when nothing was drafted."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def acceptance_by_drafter(self) -> dict[str, float]:
        """Accepted / drafted tokens per source that drafted: a draft model's own rate, apart from that of the
        n-gram drafter that may serve some steps beside it (the pipeline's helper)."""
        return acceptance_by_source(self.drafter_tokens)

    @property
    def mean_accepted_length(self) -> float:
        """Committed tokens per verify step (1.0 = no gain over plain decoding)."""
        return self.generated_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """For draft position i: accepted / drafted at that position."""
        return [a / d for a, d in zip(self.per_position_accepted, self.per_position_drafted) if d]

    @property
    def hidden_draft_share(self) -> float | None:
        """Share of drafting time hidden behind verification (0 with the pipeline off)."""
        return self.draft_hidden_s / self.draft_time_s if self.draft_time_s > 0 else None

    @property
    def draft_idle_s(self) -> float:
        return max(0.0, self.total_time_s - self.draft_time_s)

    @property
    def verify_idle_s(self) -> float:
        """Time the target waited: for drafts, and for the caller between tokens."""
        return max(0.0, self.total_time_s - self.verify_time_s)

    @property
    def estimated_speedup(self) -> float | None:
        """The reply's decode time against plain decoding's, estimated from this request's own verify time:
        its passes' cost in decode steps (each pass over K drafted tokens costs verify_curve[K]) gives the
        time of one decode step here, and plain decoding would take one step per token after the first.
        None without a measured curve or with nothing decoded after the prompt."""
        after_prompt = self.verify_steps - 1
        decode_s = self.total_time_s - self.prompt_time_s
        if not self.verify_curve or after_prompt <= 0 or decode_s <= 0 or self.generated_tokens < 2:
            return None
        drafted = (*self.per_position_drafted, 0)
        units = after_prompt - drafted[0]  # plain steps: one decode step each
        for k in range(1, len(drafted)):
            units += (drafted[k - 1] - drafted[k]) * self._pass_cost(k)
        verify_s = self.verify_time_s - self.prompt_time_s
        if units <= 0 or verify_s <= 0:
            return None
        return round((self.generated_tokens - 1) * (verify_s / units) / decode_s, 3)

    def _pass_cost(self, k: int) -> float:
        curve = self.verify_curve
        if k < len(curve):
            return curve[k]
        slope = curve[-1] - curve[-2] if len(curve) > 1 else 1.0  # past the measured range: its last slope
        return curve[-1] + (k - len(curve) + 1) * max(slope, 0.0)

    @property
    def branch_hit_rate(self) -> float | None:
        tried = self.branch_hits + self.branch_misses
        return self.branch_hits / tried if tried else None

    @property
    def branch_coverage(self) -> float | None:
        """Share of rejections on hinted steps whose correction was among the hint's top-kappa candidates:
        the hit rate branches could reach if every candidate were drafted in time."""
        return self.hinted_covered / self.hinted_rejections if self.hinted_rejections else None

    @property
    def branches_ready_share(self) -> float | None:
        """Share of the planned branches drafted to their planned length by the time the target reconciled
        (right after the pass), over the steps whose plan had arrived by then."""
        return self.branches_ready / self.branches_planned if self.branches_planned else None

    @property
    def drafter_shares(self) -> dict[str, float]:
        """Share of verify steps each source served, largest first; "none" is a plain decode step
        (nothing drafted), so the shares add up to 1 and say how much the drafters really served."""
        total = sum(self.drafters.values())
        ranked = sorted(self.drafters.items(), key=lambda kv: (-kv[1], kv[0]))
        return {source: round(n / total, 3) for source, n in ranked} if total else {}

    @property
    def drafter(self) -> str:
        """What served most verify steps: a drafter's source, "none" when plain steps were the most, or for
        a chain whose members together served most, "chain(ngram 60%, retrieval 40%)" (shares of its steps).
        On a tie a drafter wins over "none". `drafters` keeps the per-source step counts."""
        return self._most_steps(self.drafters)

    @property
    def drafted_by(self) -> str:
        """What drafted, plain steps aside: the source (or chain, with its members' shares) that served most of
        the steps that carried a draft; "none" when no step did (`drafting_share` says how many did)."""
        return self._most_steps({s: n for s, n in self.drafters.items() if s != "none"})

    @property
    def drafting_share(self) -> float:
        """The share of verify steps that carried a drafter's draft (the gate runs the others plainly)."""
        return round(1 - self.drafters.get("none", 0) / self.verify_steps, 3) if self.verify_steps else 0.0

    def _most_steps(self, drafters: dict[str, int]) -> str:
        served: Counter[str] = Counter()
        for source, n in drafters.items():
            served[_CHAIN if source in self.chain else source] += n
        if not served:
            return "none"
        top = max(served, key=lambda s: (served[s], s != "none"))
        return self._chain_name(served[_CHAIN]) if top == _CHAIN else top

    def _chain_name(self, steps: int) -> str:
        shares = ", ".join(f"{m} {self.drafters.get(m, 0) / steps:.0%}" for m in self.chain)
        return f"chain({shares})"

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            tokens_per_second=self.tokens_per_second,
            acceptance_rate=self.acceptance_rate,
            acceptance_by_drafter=self.acceptance_by_drafter,
            mean_accepted_length=self.mean_accepted_length,
            per_position_acceptance=self.per_position_acceptance,
            drafter=self.drafter,
            drafted_by=self.drafted_by,
            drafting_share=self.drafting_share,
            drafter_shares=self.drafter_shares,
            hidden_draft_share=self.hidden_draft_share,
            draft_idle_s=self.draft_idle_s,
            verify_idle_s=self.verify_idle_s,
            branch_hit_rate=self.branch_hit_rate,
            estimated_speedup=self.estimated_speedup,
            branch_coverage=self.branch_coverage,
            branches_ready_share=self.branches_ready_share,
        )
        return d


class StatsRecorder:
    """Accumulates Steps (and the request's timeline of draft/verify work) into GenerationStats: one running
    value per GenerationStats field, updated in place; snapshot() freezes them (fields are declared once,
    in GenerationStats). `fixed`: the request's own fields (prompt_tokens, pipeline, backend, ...)."""

    def __init__(self, timeline=None, **fixed) -> None:
        self.timeline = timeline
        self.values: dict = {}
        for f in fields(GenerationStats):
            default = f.default_factory() if f.default_factory is not MISSING else f.default
            # containers accumulate as their mutable kind: tuples as lists, dicts as Counters
            self.values[f.name] = list(default) if isinstance(default, tuple) else Counter() if isinstance(
                default, dict) else default
        unknown = set(fixed) - set(self.values)
        if unknown:
            raise TypeError(f"not GenerationStats fields: {sorted(unknown)}")
        self.values.update({name: list(v) if isinstance(v, tuple) else v for name, v in fixed.items()})

    def add(self, step, committed_tokens: int) -> None:
        s = self.values
        if not s["verify_steps"]:
            s["prompt_time_s"] = step.verify_time_s
        s["verify_steps"] += 1
        s["generated_tokens"] += committed_tokens
        s["drafted_tokens"] += step.drafted_tokens
        s["accepted_tokens"] += step.accepted_tokens
        s["draft_time_s"] += step.draft_time_s
        s["verify_time_s"] += step.verify_time_s
        s["drafters"][step.source] += 1
        if step.drafted_tokens:
            add_drafter_tokens(s["drafter_tokens"], step.source, step.drafted_tokens, step.accepted_tokens)
        if step.fallback:
            s["fallbacks"].append(step.fallback)
        s["branch_hits"] += step.branch == "hit"
        s["branch_misses"] += step.branch == "miss"
        if step.hint is not None:
            self._add_hint(step.hint)
        drafted, accepted = s["per_position_drafted"], s["per_position_accepted"]
        while len(drafted) < step.drafted_tokens:
            drafted.append(0)
            accepted.append(0)
        for i in range(step.drafted_tokens):
            drafted[i] += 1
            accepted[i] += i < step.accepted_tokens

    def _add_hint(self, hint) -> None:
        s = self.values
        s["branch_source"] = hint.branch_source
        s["hinted_steps"] += 1
        if hint.rejected_at is not None:
            s["hinted_rejections"] += 1
            s["hinted_covered"] += hint.covered
            s["branch_states"][hint.state] += 1
        if hint.planned is None:
            s["branch_plans_late"] += 1
        else:
            s["branches_planned"] += hint.planned
            s["branches_ready"] += hint.ready

    def snapshot(self, total_time: float) -> GenerationStats:
        frozen = {name: tuple(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v
                  for name, v in self.values.items()}
        frozen["total_time_s"] = total_time
        if not self.values["time_to_first_token_s"] and self.values["generated_tokens"]:
            self.values["time_to_first_token_s"] = frozen["time_to_first_token_s"] = total_time  # the first one
        if self.timeline is not None:  # measured busy time per worker, overlap included
            busy = self.timeline.busy
            frozen.update(draft_time_s=busy["draft"], verify_time_s=busy["verify"],
                          draft_hidden_s=self.timeline.overlap)
        return GenerationStats(**frozen)


@dataclass(frozen=True)
class TokenEvent:
    """One committed token, as it streams."""

    token_id: int
    text: str  # new text this token completes ("" while a multi-byte character is still partial)
    from_draft: bool  # True if a drafter proposed it and the target accepted it
    step: int  # index of the verify step that committed it
    stats: GenerationStats  # running statistics after that step
    logprob: TokenLogprob | None = None  # the target's, when the request asked for logprobs
    step_stats: StepStats | None = None  # what that step alone did (shared by the tokens it committed)


@dataclass(frozen=True)
class StepStats:
    """One verify step's share of the statistics: what `TokenEvent.stats` grew by with that step."""

    drafted_tokens: int  # draft tokens verified
    accepted_tokens: int  # of those, accepted
    committed_tokens: int  # tokens committed: the accepted ones + the correction or bonus token (up to an EOS)
    source: str  # the drafter that served the step ("none": a plain step)
    draft_time_s: float  # seconds the step waited for its draft
    verify_time_s: float  # seconds in the verify pass

    # the names these fields had before they took GenerationStats' names
    drafted = renamed("drafted_tokens", "drafted")
    accepted = renamed("accepted_tokens", "accepted")
    committed = renamed("committed_tokens", "committed")
    draft_s = renamed("draft_time_s", "draft_s")
    verify_s = renamed("verify_time_s", "verify_s")


@dataclass(frozen=True)
class Span:
    """A stretch of work on one lane (worker) of one request: the request's timeline, as
    `GenerationResult.spans` hands it out (and `--trace` writes it for chrome://tracing)."""

    lane: str  # "draft" or "verify"
    name: str  # "verify", "lookahead", "ngram draft", "branch 2:318", ...
    start: float  # seconds from the request's start
    seconds: float
    drafted: int = 0  # verify spans: draft tokens verified; draft spans: tokens drafted
    accepted: int | None = None  # verify spans: of those, accepted


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string), "length" (max_new_tokens or context), "cancelled"
    stats: GenerationStats
    from_draft: list[bool] = field(default_factory=list)  # per token in token_ids
    spans: tuple[Span, ...] = ()  # the draft and verify work of the request, in order of completion per lane
    logprobs: list[TokenLogprob] | None = None  # per token in token_ids, when the request asked for them

    def to_dict(self) -> dict:
        out = {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
               "stats": self.stats.to_dict()}
        if self.logprobs is not None:
            out["logprobs"] = [{"logprob": e.logprob, "top": [list(pair) for pair in e.top]} for e in self.logprobs]
        return out


@dataclass(frozen=True)
class FinishEvent:
    """Last event of a stream: the whole result. `text` is "" so `print(event.text)` loops work."""

    result: GenerationResult
    text: str = ""

    @property
    def stats(self) -> GenerationStats:
        return self.result.stats


Event = TokenEvent | FinishEvent
