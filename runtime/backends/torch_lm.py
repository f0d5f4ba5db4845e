"""The torch backend: a transformers causal LM on one torch device (the float32 reference).

Cache reconciliation and rollback are PrefixCachedLM's; this class feeds tokens through the model with
a transformers DynamicCache. A model the backend's loader switched to the batch-invariant CPU kernels
(torch_invariant.py: float32 on the CPU) gives exact verify passes, and `exact_batches` says so; any other
(a GPU, bfloat16, a model handed in as it is) does not, and it says that. It declares two capabilities: early exit (Llama/Qwen2/Mistral: the final
norm and LM head read at an intermediate layer, Mirror-SD) and thread control (torch's per-thread CPU
threads, switched between decoder layers).
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from mirrorsd.contracts import ExitRequest
from mirrorsd.errors import RollbackUnsupportedError
from mirrorsd.runtime.backends.base import PrefixCachedLM
from mirrorsd.runtime.backends.torch_invariant import runs_batch_invariant

log = logging.getLogger("mirrorsd")

EARLY_EXIT_FAMILIES = frozenset({"llama", "qwen2", "mistral"})
"""Decoder-only families whose hidden state after any layer, through the final norm and the LM head,
reads as next-token logits (no soft-capping or scaled embeddings in between)."""


class TorchCausalLM(PrefixCachedLM):
    """CausalLM on torch. `model` is the transformers module (None after close())."""

    prefill_chunk = 512
    """Prompt tokens fed per pass before the last pass (whose rows are the ones asked for): the request's cancel
    flag is checked between them. With the batch-invariant kernels a row's logits and keys do not depend on
    the pass it is in, so chunking changes nothing there; elsewhere it is simply how this backend prefills."""

    def __init__(self, model: PreTrainedModel, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.model = model.eval()
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        if next(model.parameters()).device != self.device:
            self.model.to(self.device)
        self.exact_batches = runs_batch_invariant(self.model)
        self.backend = f"torch:{self.device.type}"
        self.computes_on = "cpu" if self.device.type == "cpu" else "gpu"
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.vocab_size: int = int(model.get_output_embeddings().weight.shape[0])
        self.max_context: int = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30)
        self._check_rollback(cfg)
        # transformers >= 5.2x renamed the forward argument past_key_values -> cache.
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._cache: DynamicCache | None = None
        self.early_exit = self if _has_early_exit(model) else None
        self.threads = _TorchThreads(self._layers()) if self.device.type == "cpu" else None

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

    def _layers(self) -> list[torch.nn.Module]:
        """The decoder layers: the longest ModuleList in the model."""
        return max((m for m in self.model.modules() if isinstance(m, torch.nn.ModuleList)), key=len, default=[])

    # -- CausalLM ----------------------------------------------------------------------------------

    def _drop(self, length: int) -> None:
        if length == 0:
            self._cache = None
        elif self._cache is not None:
            self._cache.crop(length - len(self._cached))

    @torch.inference_mode()
    def _feed(self, new: list[int], rows: int, exit_request: ExitRequest | None = None) -> torch.Tensor:
        if self._cache is None:
            self._cache = DynamicCache(config=self.model.config)
        while len(new) - rows > self.prefill_chunk:  # a long prompt in chunks: a cancelled request stops early
            self._forward(new[:self.prefill_chunk], 1, None)
            new = new[self.prefill_chunk:]
            self.check_cancel()
        return self._forward(new, rows, exit_request)

    def _forward(self, new: list[int], rows: int, exit_request: ExitRequest | None) -> torch.Tensor:
        input_ids = torch.tensor([new], dtype=torch.long, device=self.device)  # [1, n_new]
        hook = self._exit_hook(exit_request, rows) if exit_request else None
        try:
            out = self.model(input_ids=input_ids, **{self._cache_kwarg: self._cache}, use_cache=True,
                             logits_to_keep=rows)
        finally:
            if hook is not None:
                hook.remove()
        self._cached.extend(new)
        return out.logits[0, -rows:].float()  # [rows, V]

    def close(self) -> None:
        self.reset()
        self.model = None

    # -- EarlyExit ---------------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.model.model.layers)

    def score_with_exit(self, committed: Sequence[int], draft: Sequence[int], request: ExitRequest) -> torch.Tensor:
        """score(), publishing the layer-l_e top-kappa of each of the k+1 rows midway through the pass."""
        return self._score(committed, draft, exit_request=request)

    def _exit_hook(self, request: ExitRequest, rows: int):
        """A forward hook on decoder layer l_e - 1: the final norm and LM head applied to its output for
        the last `rows` positions, top-kappa published before the remaining layers run. The main forward
        is untouched, so the final logits are bit-identical to a pass without it."""
        norm, head = self.model.model.norm, self.model.get_output_embeddings()
        owner = threading.get_ident()  # a draft worker may run the same model object concurrently

        def hook(module, args, output):
            if threading.get_ident() != owner:
                return
            try:
                hidden = output[0] if isinstance(output, tuple) else output  # [1, n, hidden]
                logits = head(norm(hidden[0, -rows:])).float()  # [rows, V]
                logp, ids = torch.topk(torch.log_softmax(logits, dim=-1), request.kappa, dim=-1)  # [rows, kappa]
                request.publish(ids.cpu().numpy(), logp.cpu().numpy())
            except Exception as exc:  # a hint must never break verification
                log.warning("early exit at layer %d failed: %s", request.layer, exc)

        return self.model.model.layers[request.layer - 1].register_forward_hook(hook)


def _has_early_exit(model: PreTrainedModel) -> bool:
    """Llama-family layout: model.model.layers and model.model.norm, then the LM head."""
    inner = model.get_decoder() if model.config.model_type in EARLY_EXIT_FAMILIES else None
    return (inner is not None and isinstance(getattr(inner, "layers", None),
            torch.nn.ModuleList) and isinstance(getattr(inner, "norm", None), torch.nn.Module)
            and model.get_output_embeddings() is not None)


class _TorchThreads:
    """ThreadControl for a CPU torch model: torch's intra-op threads are per calling thread (OpenMP)."""

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        self.layers = layers

    def get_threads(self) -> int:
        return torch.get_num_threads()

    def set_threads(self, n: int) -> None:
        torch.set_num_threads(n)

    def between_layers(self, callback: Callable[[], None]) -> Callable[[], None]:
        owner = threading.get_ident()

        def before(module, args) -> None:
            if threading.get_ident() == owner:
                callback()

        handles = [layer.register_forward_pre_hook(before) for layer in self.layers]
        return lambda: [h.remove() for h in handles]
