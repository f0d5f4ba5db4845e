"""A draft model on any CausalLM backend: the classic pairing (e.g. qwen2.5-coder-0.5b for the 1.5b), in
torch, exported to ONNX Runtime, or in Core ML.

It keeps its own KV cache (its CausalLM's) and reconciles it with the committed history at every
proposal, so a rejection on the target side needs no rollback call here. Greedy requests draft by
argmax (one-hot q); sampling requests draw from the draft's processed distribution and report it as
q so verify can apply rejection sampling.

With a seed, the draw at each position comes from a random stream keyed by the seed and the whole
context before it, so the token drafted after a given context is the same whichever way the runtime
gets there (drafted ahead in the pipeline, on a branch, or afresh after a rollback): a seeded run
reproduces exactly in every pipeline mode. Keys never repeat within a request (every context a step
drafts after is longer than the last committed one), so the draws stay independent.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from mirrorsd.config import GenerationConfig
from mirrorsd.contracts import CausalLM, Draft
from mirrorsd.runtime.decode.sampling import next_token_scores, sample_categorical


class ModelDrafter:
    """A Drafter that is its own DraftModel, and ranks (reports its top candidates at each position)."""

    learner = None
    bounded = False  # a model's pass on a device

    def __init__(self, lm: CausalLM, name: str | None = None) -> None:
        self.lm = lm
        self.name = name or lm.backend
        self.model = self
        self.ranking = self
        self._config = GenerationConfig()
        self._rng = np.random.default_rng()

    def start(self, config: GenerationConfig) -> None:
        self._config = config
        self._rng = np.random.default_rng()

    def _rng_for(self, context: Sequence[int]) -> np.random.Generator:
        if self._config.seed is None:
            return self._rng
        key = hashlib.blake2b(np.asarray(context, dtype=np.int64).tobytes(), digest_size=8).digest()
        return np.random.default_rng([self._config.seed, 1, int.from_bytes(key, "little")])

    def propose_iter(self, committed: Sequence[int], k: int) -> Iterator[tuple[int, np.ndarray | None]]:
        """Draft tokens one at a time: (token, q row or None when greedy). The pipeline's draft worker
        uses this to check for newer instructions between tokens."""
        for token, q, _ in self._drafted(committed, k):
            yield token, q

    def propose_ranked(self, committed: Sequence[int], k: int,
                       kappa: int) -> Iterator[tuple[int, np.ndarray | None, np.ndarray, np.ndarray]]:
        """As propose_iter, with the top-kappa ids and log-probabilities of each token's distribution (the
        processed one it was drafted from): Mirror-SD branch candidates from the draft (its ranking)."""
        for token, q, scores in self._drafted(committed, k):
            # greedy: penalised logits; sampling: the processed probabilities (q)
            logp = torch.log_softmax(scores.float(), dim=-1) if q is None else torch.log(scores.float())
            top_logp, top_ids = torch.topk(logp, min(kappa, logp.shape[-1]))
            yield token, q, top_ids.cpu().numpy(), top_logp.cpu().numpy()

    def _drafted(self, committed: Sequence[int], k: int):
        """(token, q row or None, processed scores [V]) per drafted position."""
        cfg = self._config
        context = list(committed)
        for _ in range(min(k, self.lm.max_context - len(context))):
            logits = self.lm.score(context)  # [1, V]; feeds only what the cache lacks
            scores = next_token_scores(logits, cfg.sampling, context)[0]  # [V]
            if cfg.greedy:
                token, q = int(scores.argmax()), None
            else:
                q = scores.double().cpu().numpy()
                token = sample_categorical(q, self._rng_for(context))
            yield token, q, scores
            context.append(token)

    def propose(self, committed: Sequence[int], k: int) -> Draft:
        pairs = list(self.propose_iter(committed, k))
        probs = [q for _, q in pairs if q is not None]
        return Draft([t for t, _ in pairs], np.stack(probs) if probs else None, self.name)

    def accepted(self, committed: Sequence[int], n_accepted: int) -> None:
        pass  # the next propose() truncates the cache to the committed prefix

    def close(self) -> None:
        self.lm.close()
