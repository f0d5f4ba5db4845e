"""Retrieval drafting: a token datastore (suffix array over a corpus) and the drafter that reads it."""

from mirrorsd.runtime.drafters.retrieval.drafter import RetrievalDrafter

__all__ = ["RetrievalDrafter"]
