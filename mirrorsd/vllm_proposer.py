"""Deprecated path of the vLLM proposers, kept for handoff folders that name it: they live in
mirrorsd.apps.handoff.vllm_proposer, the name `mirrorsd handoff` writes."""

import warnings

from mirrorsd._lazy import lazy_names

SOURCES = {"mirrorsd.apps.handoff.vllm_proposer": ("DATASTORE_ENV", "ChainProposer", "RetrievalProposer")}
__all__ = [name for names in SOURCES.values() for name in names]
__getattr__ = lazy_names(globals(), SOURCES)

warnings.warn("mirrorsd.vllm_proposer is deprecated: name mirrorsd.apps.handoff.vllm_proposer (mirrorsd handoff "
              "writes it)", DeprecationWarning, stacklevel=2)
