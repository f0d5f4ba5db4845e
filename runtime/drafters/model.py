"""Independent draft model on torch: the classic pairing (e.g. qwen2.5-coder-0.5b for the 1.5b).

It keeps its own KV cache (a TorchCausalLM) and reconciles it with the committed history at every
proposal, so a rejection on the target side needs no rollback call here. Greedy requests draft by
argmax (one-hot q); sampling requests draw from the draft's processed distribution and report it as
q so verify can apply rejection sampling.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mirrorsd.config import GenerationConfig
from mirrorsd.contracts import Draft
from mirrorsd.runtime.torch_model import TorchCausalLM
from mirrorsd.sampling import next_token_scores, sample_categorical


class TorchDraftModel:
    def __init__(self, lm: TorchCausalLM, name: str | None = None) -> None:
        self.lm = lm
        self.name = name or f"torch:{lm.device.type}"
        self._config = GenerationConfig()
        self._rng = np.random.default_rng()

    def start(self, config: GenerationConfig) -> None:
        self._config = config
        # A stream of its own, so drafting never shifts the verifier's random numbers.
        self._rng = np.random.default_rng(None if config.seed is None else [config.seed, 1])

    def propose(self, committed: Sequence[int], max_tokens: int) -> Draft:
        cfg = self._config
        context = list(committed)
        room = self.lm.max_context - len(context)
        tokens: list[int] = []
        probs: list[np.ndarray] = []
        for _ in range(min(max_tokens, room)):
            logits = self.lm.score(context)  # [1, V]; feeds only what the cache lacks
            scores = next_token_scores(logits, cfg, context)[0]  # [V]
            if cfg.greedy:
                token = int(scores.argmax())
            else:
                q = scores.double().cpu().numpy()
                token = sample_categorical(q, self._rng)
                probs.append(q)
            tokens.append(token)
            context.append(token)
        return Draft(tokens, np.stack(probs) if probs else None, self.name)

    def accepted(self, committed: Sequence[int], n_accepted: int) -> None:
        pass  # the next propose() truncates the cache to the committed prefix
