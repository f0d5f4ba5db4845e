"""Drafters: each proposes tokens and owns its state (see mirrorsd.contracts.Drafter)."""

from mirrorsd.runtime.drafters.chain import ChainDrafter
from mirrorsd.runtime.drafters.factory import helper_for, make_drafter
from mirrorsd.runtime.drafters.model import ModelDrafter
from mirrorsd.runtime.drafters.ngram import NGramDrafter
from mirrorsd.runtime.drafters.retrieval import RetrievalDrafter

__all__ = ["ChainDrafter", "ModelDrafter", "NGramDrafter", "RetrievalDrafter", "helper_for", "make_drafter"]
