"""Drafters: each proposes tokens and owns its state (see mirrorsd.contracts.Drafter)."""

from mirrorsd.runtime.drafters.model import TorchDraftModel
from mirrorsd.runtime.drafters.ngram import NGramDrafter

__all__ = ["NGramDrafter", "TorchDraftModel"]
