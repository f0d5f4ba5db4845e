"""The part every exported-draft LM shares: a KV cache whose valid length is a pointer.

Subclasses (OnnxCausalLM, CoreMLCausalLM) keep the cache where their runtime wants it (numpy
arrays, Core ML state) and implement `_feed`. This class reconciles against the caller's token
history the way TorchCausalLM does: longest common prefix, move the pointer there, feed the rest.
Rolling back rejected draft tokens is only moving the pointer: slots past it are masked out and
overwritten by the next tokens written there.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mirrorsd.errors import PromptError
from mirrorsd.runtime.backends.torch_lm import common_prefix


class HostCacheLM:
    max_context: int
    vocab_size: int

    def __init__(self) -> None:
        self._cached: list[int] = []  # tokens whose keys/values sit in slots [0, pointer)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # logits come back on the host whatever runs the graph

    def reset(self) -> None:
        self._cached = []

    def truncate(self, length: int) -> None:
        del self._cached[length:]

    def _common_prefix(self, tokens: Sequence[int]) -> int:
        return common_prefix(self._cached, tokens)

    def score(self, committed: Sequence[int], draft: Sequence[int] = ()) -> torch.Tensor:
        """Logits [k+1, V] (float32): row i is the distribution after committed + draft[:i]."""
        if not committed:
            raise PromptError("cannot score an empty context", "give the model at least one prompt token")
        tokens = [int(t) for t in committed] + [int(t) for t in draft]
        if len(tokens) > self.max_context:
            raise PromptError(f"{len(tokens)} tokens exceed the exported draft's context of {self.max_context}",
                              "re-export with a larger --max-context")
        keep = min(self._common_prefix(tokens), len(committed) - 1)
        self.truncate(keep)
        rows = self._feed(tokens[keep:])
        return torch.from_numpy(np.ascontiguousarray(rows[-(len(draft) + 1):], dtype=np.float32))

    def _feed(self, new: list[int]) -> np.ndarray:
        """Write the new tokens' keys/values at the pointer (advancing it); logits [len(new), V]."""
        raise NotImplementedError
