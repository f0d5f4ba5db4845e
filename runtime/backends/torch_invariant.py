"""Batch-invariant float32 kernels for the torch backend on the CPU: every position of a verify pass gets
bit for bit the logits one-token decoding gives it.

A float32 transformers model depends on the batch in two places; norms, RoPE, activations and residual
adds work row by row already.
- Linear layers. oneDNN's inner product (cpu_kernels.OneDNNLinear) gives a row the same bits for any row
  count from 2 up, but runs a single row through another kernel. So a one-row input is computed as two rows
  (itself twice) and the first is kept: decode steps pay for it, verify passes do not.
- Attention. SDPA over a block of queries under a causal mask reduces in another order than one query over
  its prefix. Each query row is computed as one-token decoding computes it: one query over exactly the keys
  before it.
What it costs is measured in docs/exactness.md.
"""

from __future__ import annotations

import torch

from mirrorsd.runtime.backends.cpu_kernels import OneDNNLinear, onednn_linear_available, onednn_linear_wanted

ROWWISE_ATTENTION = "mirrorsd_rowwise"

FAMILIES = frozenset({"llama", "qwen2", "mistral"})
"""Plain causal attention (no soft-capping, sinks or per-layer masks beyond a sliding window, which the
backend caps the context at): the row-by-row attention computes the same function."""


class BatchInvariantLinear(OneDNNLinear):
    """OneDNNLinear whose single-row inputs go through the multi-row kernel (as two equal rows)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() != x.shape[-1] or torch.is_grad_enabled():
            return super().forward(x)
        two = x.reshape(1, -1).expand(2, -1)
        return torch.ops.mkldnn._linear_pointwise(two, self.weight, self.bias, "none", [], "")[:1].reshape(
            *x.shape[:-1], -1)


def rowwise_attention(module, query, key, value, attention_mask, **kwargs):
    """Attention of each query row over its own prefix alone, as in one-token decoding.
    query [B, H, n, D] for the last n of the key/value positions [B, H_kv, total, D]; no padding (one sequence)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.pop("is_causal", None)
    n, total = query.shape[2], key.shape[2]
    rows = [sdpa_attention_forward(module, query[:, :, i:i + 1], key[:, :, :total - n + i + 1],
                                   value[:, :, :total - n + i + 1], None, is_causal=False, **kwargs)[0]
            for i in range(n)]  # each [B, 1, H, D]
    return torch.cat(rows, dim=1), None  # [B, n, H, D]


def _float32_cpu(model: torch.nn.Module) -> bool:
    params = list(model.parameters())
    return bool(params) and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params)


def make_batch_invariant(model: torch.nn.Module) -> bool:
    """Switch a float32 CPU model of a plain-attention family to the batch-invariant kernels, in place (same
    weights and module tree). False, leaving the model as it was, where they do not apply (or
    MIRRORSD_CPU_LINEAR=default asks for torch's own kernels). The torch backend's loader calls it on the
    model it loads; a model handed to TorchCausalLM directly is left to its owner."""
    family = getattr(model.config, "model_type", None)
    if (not onednn_linear_wanted() or family not in FAMILIES or not _float32_cpu(model)
            or not onednn_linear_available() or not hasattr(model, "set_attn_implementation")):
        return False
    linears = [m for m in model.modules() if type(m) in (torch.nn.Linear, OneDNNLinear)]
    from transformers import AttentionInterface

    AttentionInterface.register(ROWWISE_ATTENTION, rowwise_attention)
    try:
        model.set_attn_implementation(ROWWISE_ATTENTION)
    except (ValueError, TypeError):
        return False
    for m in linears:
        m.__class__ = BatchInvariantLinear
    return True


def runs_batch_invariant(model: torch.nn.Module) -> bool:
    """Whether the model runs the batch-invariant kernels now: switched, and still float32 on the CPU."""
    return (getattr(model.config, "_attn_implementation", None) == ROWWISE_ATTENTION and _float32_cpu(model)
            and all(type(m) is BatchInvariantLinear for m in model.modules() if isinstance(m, torch.nn.Linear)))
