"""Draft length K per step."""

from __future__ import annotations

from mirrorsd.config import GenerationConfig


class DraftLengthSchedule:
    """transformers' heuristic: all K accepted -> K += 2; otherwise K -= 1; within [1, max_draft_tokens].
    With adaptive_k off, K stays at num_draft_tokens."""

    def __init__(self, config: GenerationConfig) -> None:
        self.adaptive = config.adaptive_k
        self.max_k = config.max_draft_tokens
        self.k = min(config.num_draft_tokens, self.max_k)

    def update(self, n_drafted: int, n_accepted: int) -> int:
        if self.adaptive and n_drafted > 0 and self.k > 0:
            self.k = min(self.k + 2, self.max_k) if n_accepted == n_drafted else max(self.k - 1, 1)
        return self.k
