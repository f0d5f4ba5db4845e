"""The small contracts between the loop, the drafters and the verifier."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from mirrorsd.config import GenerationConfig


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

    @staticmethod
    def empty(source: str = "none") -> "Draft":
        return Draft([], None, source)


@runtime_checkable
class Drafter(Protocol):
    """Proposes tokens. Owns its own state and reconciles it against the committed history on
    every call, so the loop never has to roll a drafter back."""

    name: str

    def start(self, config: GenerationConfig) -> None:
        """A new request begins with these settings (drafters that sample seed themselves here)."""

    def propose(self, committed: Sequence[int], max_tokens: int) -> Draft:
        """Up to max_tokens tokens likely to follow `committed`. An empty draft is a normal result."""

    def accepted(self, committed: Sequence[int], n_accepted: int) -> None:
        """Feedback after a verify step: `committed` now ends with the accepted tokens + 1."""

    # Optional: finish(prompt_ids, generated) is called when a request completes (not when it is
    # cancelled); the retrieval drafter learns the reply there.


@runtime_checkable
class Verifier(Protocol):
    """The target model on its device. Rollback (truncate) is a checked capability."""

    vocab_size: int
    max_context: int

    def score(self, committed: Sequence[int], draft: Sequence[int]) -> torch.Tensor:
        """Logits [k+1, vocab]: row i predicts the token after committed + draft[:i]."""

    def truncate(self, length: int) -> None:
        """Drop cached positions >= length."""
