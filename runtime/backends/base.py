"""PrefixCachedLM: the cache reconciliation every backend shares, written once.

A backend keeps a KV cache for the token ids in `_cached`. `score(committed, draft)` finds the longest
common prefix of the cache and committed + draft, truncates the cache there (but keeps at least one
committed token to feed: its logits start the result), feeds the rest in one call and returns the
last k+1 rows. Rollback after a rejected draft is therefore implicit in the next `score`.

A backend subclass implements `_feed(new, rows)` (run the new tokens, extend the cache, return logits
for the last `rows` of them) and `_drop(length)` (shrink the cache to `length` positions). Backends
whose cache is a pointer into preallocated slots (the exported drafts) drop by moving the pointer,
which `_cached` already is.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from mirrorsd.errors import PromptError, RequestCancelled


def common_prefix(cached: list[int], tokens: Sequence[int]) -> int:
    """Length of the longest common prefix of a cache's token history and `tokens` (fast path: the
    cache is a prefix of them, the usual case when decoding moves forward)."""
    n = len(cached)
    if len(tokens) >= n and list(tokens[:n]) == cached:
        return n
    i = 0
    for a, b in zip(cached, tokens):
        if a != b:
            break
        i += 1
    return i


class PrefixCachedLM:
    """Base of the CausalLM backends (see mirrorsd.contracts.CausalLM)."""

    max_context: int
    vocab_size: int
    exact_batches = False  # a verify pass reproduces one-token logits bit for bit: only where measured so
    context_hint = "shorten the prompt or lower max_new_tokens"
    cancel: threading.Event | None = None
    """The running request's cancel flag (set by the Engine for the request's duration): a backend that feeds a long
    prompt in chunks checks it between chunks (check_cancel), so a request whose client left stops within one
    chunk instead of at the end of its prefill."""

    def check_cancel(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise RequestCancelled("the request was cancelled during its prompt", "")

    def __init__(self) -> None:
        self._cached: list[int] = []  # token ids whose keys/values are in the cache

    def reset(self) -> None:
        self._drop(0)
        self._cached = []

    def truncate(self, length: int) -> None:
        """Drop cached positions >= length (a no-op when the cache is already that short)."""
        if length < 0:
            raise ValueError(f"cannot truncate to a negative length ({length})")
        if length >= len(self._cached):
            return
        try:
            self._drop(length)
        except BaseException:  # interrupted midway (Ctrl-C): the cache may be inconsistent now
            self.reset()
            raise
        del self._cached[length:]

    def cached_prefix(self, tokens: Sequence[int]) -> int:
        return common_prefix(self._cached, tokens)

    def score(self, committed: Sequence[int], draft: Sequence[int] = ()) -> torch.Tensor:
        """Logits [k+1, V] (float32): row i is the distribution after committed + draft[:i]."""
        return self._score(committed, draft)

    def _score(self, committed: Sequence[int], draft: Sequence[int], **feed_options) -> torch.Tensor:
        if not committed:
            raise PromptError("cannot score an empty context", "give the model at least one prompt token")
        tokens = [int(t) for t in committed] + [int(t) for t in draft]
        if len(tokens) > self.max_context:
            raise PromptError(f"{len(tokens)} tokens exceed the model's context window of {self.max_context}",
                              self.context_hint)
        keep = min(common_prefix(self._cached, tokens), len(committed) - 1)
        self.truncate(keep)
        try:
            return self._feed(tokens[keep:], len(draft) + 1, **feed_options)
        except BaseException:
            # Interrupted mid-pass (Ctrl-C, out of memory): part of the cache may have been written, so
            # it no longer matches _cached. Start the next request afresh.
            self.reset()
            raise

    def _feed(self, new: list[int], rows: int) -> torch.Tensor:
        """Run `new` after the cached tokens, append them to `_cached`; logits [rows, V] of the last rows."""
        raise NotImplementedError

    def _drop(self, length: int) -> None:
        """Shrink the backend's cache to `length` positions (`_cached` is shortened by the caller)."""
        raise NotImplementedError

    def close(self) -> None:
        self.reset()
