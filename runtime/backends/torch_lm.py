"""A transformers causal LM on one torch device with a truncatable KV cache.

The verifier is one of these; so is the state of the torch draft-model drafter. `score` reconciles
the cache with the caller's token history (longest common prefix, then truncate), feeds only what
the cache lacks, and returns logits for the last committed token and each draft token. Rollback
after a rejection is therefore implicit: the next call truncates to what was committed.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from mirrorsd.errors import PromptError, RollbackUnsupportedError

log = logging.getLogger("mirrorsd")

EARLY_EXIT_FAMILIES = frozenset({"llama", "qwen2", "mistral"})
"""Decoder-only families whose hidden state after any layer, through the final norm and the LM head,
reads as next-token logits (no soft-capping or scaled embeddings in between)."""

EarlyExitCallback = Callable[[torch.Tensor, torch.Tensor], None]
"""Receives (top-kappa token ids [k+1, kappa], their log-probabilities [k+1, kappa]) at layer l_e."""


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


class TorchCausalLM:
    """Verifier protocol implementation: score(committed, draft) -> [k+1, V], truncate(length)."""

    def __init__(self, model: PreTrainedModel, device: torch.device | str | None = None) -> None:
        self.model = model.eval()
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        if next(model.parameters()).device != self.device:
            self.model.to(self.device)
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.vocab_size: int = int(model.get_output_embeddings().weight.shape[0])
        self.max_context: int = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30)
        self._check_rollback(cfg)
        # transformers >= 5.2x renamed the forward argument past_key_values -> cache.
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._cache: DynamicCache | None = None
        self._cached: list[int] = []  # token ids whose keys/values are in the cache

    def _check_rollback(self, cfg) -> None:
        """Speculative decoding drops rejected positions from the cache. Full attention truncates
        exactly; sliding-window attention only until the window fills, so the usable context is capped
        there; recurrent or linear-attention state cannot be rolled back at all and is refused."""
        layer_types = set(getattr(cfg, "layer_types", None) or [])
        unsupported = layer_types - {"full_attention", "sliding_attention"}
        if unsupported:
            raise RollbackUnsupportedError(
                f"{cfg.model_type} has layers of type {sorted(unsupported)} whose cache cannot be "
                "truncated after a rejected draft",
                "use a transformer with attention layers only as the target or draft",
            )
        sliding = getattr(cfg, "sliding_window", None)
        if sliding and (getattr(cfg, "use_sliding_window", True) or "sliding_attention" in layer_types):
            self.max_context = min(self.max_context, int(sliding))

    @property
    def num_layers(self) -> int:
        return len(self.model.model.layers) if self.supports_early_exit else 0

    @property
    def supports_early_exit(self) -> bool:
        """Mirror-SD's early exit: read the LM head at an intermediate layer during the verify pass."""
        inner = getattr(self.model, "model", None)
        return (self.model.config.model_type in EARLY_EXIT_FAMILIES and hasattr(inner, "layers")
                and hasattr(inner, "norm") and self.model.get_output_embeddings() is not None)

    def _early_exit_hook(self, layer: int, kappa: int, rows: int, callback: EarlyExitCallback):
        """A forward hook on decoder layer `layer` - 1: the final norm and LM head applied to its output
        for the last `rows` positions, top-kappa handed to `callback` before the remaining layers run.
        The main forward is untouched, so the final logits are bit-identical to a pass without it."""
        norm, head = self.model.model.norm, self.model.get_output_embeddings()
        owner = threading.get_ident()  # a draft worker may run the same model object concurrently

        def hook(module, args, output):
            if threading.get_ident() != owner:
                return
            try:
                hidden = output[0] if isinstance(output, tuple) else output  # [1, n, hidden]
                logits = head(norm(hidden[0, -rows:])).float()  # [rows, V]
                logp, ids = torch.topk(torch.log_softmax(logits, dim=-1), kappa, dim=-1)  # [rows, kappa]
                callback(ids, logp)
            except Exception as exc:  # a hint must never break verification
                log.warning("early exit at layer %d failed: %s", layer, exc)

        return self.model.model.layers[layer - 1].register_forward_hook(hook)

    def reset(self) -> None:
        self._cache = None
        self._cached = []

    def truncate(self, length: int) -> None:
        """Drop cached positions >= length (a no-op when the cache is already that short)."""
        if length < 0:
            raise ValueError(f"cannot truncate to a negative length ({length})")
        extra = len(self._cached) - length
        if extra <= 0:
            return
        if length == 0:
            self.reset()
            return
        try:
            self._cache.crop(-extra)
        except BaseException:  # interrupted midway (Ctrl-C): layers may differ in length now
            self.reset()
            raise
        del self._cached[length:]

    def _common_prefix(self, tokens: Sequence[int]) -> int:
        return common_prefix(self._cached, tokens)

    @torch.inference_mode()
    def score(self, committed: Sequence[int], draft: Sequence[int] = (),
              early_exit: tuple[int, int, EarlyExitCallback] | None = None) -> torch.Tensor:
        """Logits [k+1, V] (float32): row i is the distribution after committed + draft[:i].

        early_exit: (layer l_e, kappa, callback) to publish the top-kappa tokens of each of the k+1
        rows at layer l_e, midway through this pass (see supports_early_exit)."""
        if not committed:
            raise PromptError("cannot score an empty context", "give the model at least one prompt token")
        tokens = list(committed) + list(draft)
        if len(tokens) > self.max_context:
            raise PromptError(
                f"{len(tokens)} tokens exceed the model's context window of {self.max_context}",
                "shorten the prompt or lower max_new_tokens",
            )
        # Keep at least the last committed token to feed: its logits start the result.
        keep = min(self._common_prefix(tokens), len(committed) - 1)
        self.truncate(keep)
        new = tokens[keep:]
        if self._cache is None:
            self._cache = DynamicCache(config=self.model.config)
        input_ids = torch.tensor([new], dtype=torch.long, device=self.device)  # [1, n_new]
        hook = self._early_exit_hook(early_exit[0], early_exit[1], len(draft) + 1, early_exit[2]) if early_exit else None
        try:
            out = self.model(
                input_ids=input_ids,
                **{self._cache_kwarg: self._cache},
                use_cache=True,
                logits_to_keep=len(draft) + 1,
            )
            self._cached.extend(new)
        except BaseException:
            # Interrupted mid-forward (Ctrl-C, out of memory): some layers may have appended to the
            # cache and others not, so it no longer matches _cached. Start the next request afresh.
            self.reset()
            raise
        finally:
            if hook is not None:
                hook.remove()
        return out.logits[0, -(len(draft) + 1):].float()  # [k+1, V]
