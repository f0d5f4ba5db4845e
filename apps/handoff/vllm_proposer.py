"""mirrorsd's model-free drafters inside vLLM, as `custom_class` proposers (`mirrorsd handoff --draft chain`).

vLLM calls `propose` once per engine step with every running request's token history; each proposer answers
with mirrorsd's own drafter, so a datastore built with `mirrorsd datastore build` drafts for a vLLM deployment
as it does here. vLLM's rejection sampler verifies the drafts, so they change speed, never the output.

Install mirrorsd into vLLM's environment without its dependencies (`pip install --no-deps PATH`): vLLM pins
its own torch and transformers, and the proposers need only numpy and the target's tokenizer. The datastore
is the folder in `MIRRORSD_DATASTORE` (serve.sh sets it), else the standard-library one for the target's
tokenizer (built once, as `--draft retrieval` does).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

DATASTORE_ENV = "MIRRORSD_DATASTORE"


class _Proposer:
    """vLLM's custom_class contract: built with the VllmConfig, `propose` returns one draft per request."""

    def __init__(self, vllm_config) -> None:
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.drafter = self.make_drafter(vllm_config.model_config.tokenizer)

    def make_drafter(self, tokenizer_path: str):
        raise NotImplementedError

    def load_model(self, *args, **kwargs) -> None:
        """vLLM asks every proposer to load its model: these have none."""

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings=None) -> list[list[int]]:
        """Drafts for each request in the batch: `token_ids_cpu[i, :num_tokens_no_spec[i]]` is request i's
        prompt and reply so far; a request that sampled nothing this step, or is at the context limit, gets none."""
        drafts = []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            room = min(self.k, self.max_model_len - n - 1)
            if not len(sampled) or room <= 0:
                drafts.append([])
                continue
            drafts.append([int(t) for t in self.drafter.propose(token_ids_cpu[i, :n].tolist(), room).tokens])
        return drafts


def _datastore(tokenizer_path: str):
    from transformers import AutoTokenizer

    from mirrorsd.drafters import Datastore, default_datastore

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    where = os.environ.get(DATASTORE_ENV)
    return Datastore.open(where, tokenizer) if where else default_datastore(tokenizer)


class RetrievalProposer(_Proposer):
    """Continues each request with what followed its context in the datastore."""

    def make_drafter(self, tokenizer_path: str):
        from mirrorsd.drafters import RetrievalDrafter

        return RetrievalDrafter(_datastore(tokenizer_path))


class ChainProposer(_Proposer):
    """The request's own n-grams first, the datastore where they find nothing longer (mirrorsd's chain)."""

    def make_drafter(self, tokenizer_path: str):
        from mirrorsd.drafters import ChainDrafter, NGramDrafter, RetrievalDrafter

        return ChainDrafter(NGramDrafter(), RetrievalDrafter(_datastore(tokenizer_path)))
