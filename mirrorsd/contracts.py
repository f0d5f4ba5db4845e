"""The small contracts between the loops, the drafters and the model backends.

Records: `Draft` (what a drafter proposes), `Step` (what one verify step committed) and `HintOutcome`
(how a step with Mirror-SD branch candidates ended).
Protocols:
- `CausalLM`: one model on one device (a backend: torch, ONNX Runtime, Core ML, ...). The target is
  one; a model drafter drafts with one. Optional capabilities are *declared* as attributes that hold
  an implementation or None (`early_exit`, `threads`), never discovered by probing.
- `Drafter`: proposes tokens. Its abilities are declared the same way: `model` (a `DraftModel`: it runs
  a CausalLM, token by token, and may hold a `Ranking` of its top candidates per drafted position) and
  `learner` (a `Learner`: it learns from finished replies), each an implementation or None.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import numpy as np
import torch

from mirrorsd._deprecated import renamed
from mirrorsd.config import GenerationConfig

ComputeKind = Literal["cpu", "gpu", "npu"]


# -- records ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Draft:
    """What a drafter proposes for the next verify step."""

    tokens: list[int]
    """k proposed token ids; k may be 0 (then the step is a plain decode step)."""
    probs: np.ndarray | None
    """[k, vocab] draft distribution q the tokens were sampled from; None means one-hot (n-gram,
    retrieval, greedy drafting)."""
    source: str
    """Who drafted: "ngram", "torch:cpu", "onnx:QNN", ... (reported in stats)."""
    match: int = 0
    """The length of the suffix match a model-free drafter continued (n-gram, retrieval); 0 for a model's
    draft. A 1-token match is accepted far less often than a longer one, so the step policy keeps acceptance
    per (source, match length) and verifies each draft only as far as its own kind pays."""

    @staticmethod
    def empty(source: str = "none") -> "Draft":
        return Draft([], None, source)


@dataclass(frozen=True)
class Step:
    """One verify step's outcome, as every decode loop yields it."""

    tokens: list[int]
    """Committed this step: the accepted draft tokens + the correction or bonus token."""
    drafted_tokens: int
    accepted_tokens: int
    source: str
    """The drafter that served this step ("none" for a plain decode step)."""
    draft_time_s: float
    """Seconds the step waited for its draft (pipeline off: spent in propose)."""
    verify_time_s: float
    """Seconds spent in score() + verify()."""
    fallback: str | None = None
    """Why a drafter was dropped during this step, if one was."""
    branch: Literal["hit", "miss"] | None = None
    """Pipeline with early-exit branches: whether a step that left the lookahead landed on a prepared
    branch; None when no branch was prepared or the step stayed on the lookahead."""
    logprobs: tuple[TokenLogprob, ...] | None = None
    """One per committed token, when the request asks for log-probabilities."""
    hint: HintOutcome | None = None
    """Pipeline with branches: how a hinted step (one whose candidates reached the draft worker) ended,
    measured against its hint; None for steps without a hint."""

    # the names these fields had before they took GenerationStats' names
    n_drafted = renamed("drafted_tokens", "n_drafted")
    n_accepted = renamed("accepted_tokens", "n_accepted")
    draft_time = renamed("draft_time_s", "draft_time")
    verify_time = renamed("verify_time_s", "verify_time")


BranchState = Literal["ready", "drafting", "queued", "none"]
"""Where the branch for a step's actual outcome stood when the target reconciled (right after the pass):
drafted to its planned length, still being drafted, planned but not started, or not planned at all."""


@dataclass(frozen=True)
class HintOutcome:
    """A hinted step measured against its hint (Mirror-SD branches; see GenerationStats.branch_coverage)."""

    branch_source: Literal["early_exit", "draft"]
    """Where the step's candidates came from: the target's layer-l_e top-kappa, or the draft model's own."""
    rejected_at: int | None
    """n_accepted when a drafted token was rejected; None when every drafted token was accepted."""
    correction: int
    """The step's last committed token: the correction (or the bonus token when nothing was rejected)."""
    covered: bool
    """The correction was among the hint's top-kappa candidates at that position."""
    state: BranchState
    """The branch for (rejected_at or k, correction) at reconcile time."""
    planned: int | None
    """Branches the draft worker planned for this step; None when its plan had not reached the target by
    reconcile (the worker was still busy with the token it was drafting when the hint came)."""
    ready: int = 0
    """Of the planned branches, those drafted to their planned length by reconcile."""


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one committed token, and its likeliest alternatives."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """(token id, log-probability) of the most likely tokens at that position, likeliest first."""


# -- model backends --------------------------------------------------------------------------------

EarlyExitCallback = Callable[[np.ndarray, np.ndarray], None]
"""Receives (top-kappa token ids [k+1, kappa], their log-probabilities [k+1, kappa]) at layer l_e."""


@dataclass(frozen=True)
class ExitRequest:
    """Read the LM head at layer `layer` (1-based) during a verify pass and publish its top `kappa`."""

    layer: int
    kappa: int
    publish: EarlyExitCallback


class EarlyExit(Protocol):
    """Capability: Mirror-SD's early exit. The final logits must be exactly those of `CausalLM.score`."""

    num_layers: int

    def score_with_exit(self, committed: Sequence[int], draft: Sequence[int], request: ExitRequest) -> torch.Tensor:
        """As CausalLM.score, publishing the layer-l_e top-kappa of each of the k+1 rows midway."""


class ThreadControl(Protocol):
    """Capability: the backend's CPU threads can be changed between passes and between layers (the
    pipeline lends a CPU draft worker's cores to the verify pass while the worker is idle)."""

    def get_threads(self) -> int:
        """Threads for passes run by the calling thread."""

    def set_threads(self, n: int) -> None:
        """Threads for passes run by the calling thread from now on."""

    def between_layers(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` before each layer of passes run by the calling thread; returns a remover."""


@runtime_checkable
class CausalLM(Protocol):
    """One model on one device with a truncatable KV cache.

    `score` reconciles the cache with the caller's history (longest common prefix), feeds only what the
    cache lacks, and returns logits for the last committed token and each draft token; rollback after a
    rejection is therefore implicit. Implementations: runtime/backends/ (torch, ONNX Runtime, Core ML)."""

    backend: str
    """Names the backend and device for stats: "torch:cpu", "onnx:CPU", "coreml", ..."""
    computes_on: ComputeKind
    """Whose compute the forward passes use (an ONNX model on the CPU provider: "cpu"; on QNN: "npu")."""
    vocab_size: int
    max_context: int
    early_exit: EarlyExit | None
    threads: ThreadControl | None
    exact_batches: bool
    """Whether a pass over n positions gives each the very logits (bit for bit) of scoring it alone:
    speculation is then exactly lossless. A backend that is not says so, and `draft="auto"` does not
    speculate on it unless asked (runtime/backends/invariance.py measures it)."""

    def score(self, committed: Sequence[int], draft: Sequence[int] = ()) -> torch.Tensor:
        """Logits [k+1, V] (float32, on the host or the model's device): row i follows committed + draft[:i]."""

    def truncate(self, length: int) -> None:
        """Drop cached positions >= length."""

    def cached_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` the cache already holds (what a prompt need not prefill)."""

    def reset(self) -> None:
        """Forget the whole cache."""

    def close(self) -> None:
        """Free the model's memory; the object is unusable afterwards."""


# -- drafters --------------------------------------------------------------------------------------

class Drafter(Protocol):
    """Proposes tokens. Owns its own state and reconciles it against the committed history on
    every call, so the loop never has to roll a drafter back. Its abilities beyond proposing are
    declared as backends' are: an attribute holding an implementation, or None."""

    name: str
    model: DraftModel | None
    """Where the drafter runs a model (token by token, on a device, with memory to free); None for
    model-free drafters, which take microseconds on the host."""
    learner: Learner | None
    """Where the drafter learns from finished requests (retrieval appends replies to its datastore)."""
    bounded: bool
    """Every call returns promptly, computing in memory on the host (mirrorsd's n-gram and retrieval lookups): it
    runs on the request's own thread. False: it runs on a drafting thread the request can abandon if it hangs
    (a model, I/O, anyone else's code), at the cost of a thread hand-off per call."""

    def start(self, config: GenerationConfig) -> None:
        """A new request begins with these settings (drafters that sample seed themselves here)."""

    def propose(self, committed: Sequence[int], k: int) -> Draft:
        """Up to k tokens likely to follow `committed`. An empty draft is a normal result."""

    def accepted(self, committed: Sequence[int], n_accepted: int) -> None:
        """Feedback after a verify step: `committed` now ends with the accepted tokens + 1."""


class DraftModel(Protocol):
    """A drafter's model (`lm`): it drafts token by token, so the pipeline's draft worker can take new
    instructions between tokens."""

    lm: CausalLM
    ranking: Ranking | None
    """Where the model reports its top candidates at each drafted position (the distribution it computes
    anyway): Mirror-SD branches can then come from the draft instead of the target's early exit."""

    def propose_iter(self, committed: Sequence[int], k: int) -> Iterator[tuple[int, np.ndarray | None]]:
        """Draft tokens one at a time: (token, its q row, or None when drafting greedily)."""

    def close(self) -> None:
        """Free the model."""


class Ranking(Protocol):
    def propose_ranked(self, committed: Sequence[int], k: int,
                       kappa: int) -> Iterator[tuple[int, np.ndarray | None, np.ndarray, np.ndarray]]:
        """As propose_iter, each token with the top-kappa ids [kappa] and log-probabilities [kappa] of the
        distribution it was drafted from (after the request's sampling processing), likeliest first."""


class Learner(Protocol):
    def finish(self, prompt_ids: Sequence[int], generated: Sequence[int]) -> None:
        """A request completed (not cancelled) with these generated tokens."""


def computes_on(drafter: Drafter | None) -> ComputeKind | None:
    """Where a drafter's model computes; None for model-free drafters (microseconds on the host)."""
    return drafter.model.lm.computes_on if drafter is not None and drafter.model is not None else None
