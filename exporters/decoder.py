"""The draft model as an explicit-cache decoder: the graph every exporter writes.

`ExplicitCacheDecoder` re-expresses a Llama-family transformers model (Llama, Qwen2: q/k/v
projections with or without bias, grouped-query attention, RoPE, RMSNorm, gated MLP) as a pure
function of its inputs, so nothing about the cache lives inside the graph:

    inputs   input_ids [1, T] int64, position_ids [1, T] int64,
             attention_mask [1, 1, T, P + T] float32 (additive: 0 = attend, MASK_MIN = hidden),
             past_key_i / past_value_i [1, n_kv, P, head_dim] float32 for each layer i
    outputs  logits [1, T, vocab] float32,
             new_key_i / new_value_i [1, n_kv, T, head_dim]: keys/values of the T new tokens only

The host owns the cache. In the NPU profile P is the fixed cache size and T a fixed block size
(1 for a decode step, C for a prefill chunk); the host writes the new keys/values at its write
pointer, and rolling back rejected draft tokens is moving that pointer back (positions past it are
masked out). In the dynamic profile P and T vary and the host passes the cache up to the pointer.
The layers' own modules (projections, norms, MLP, rotary embedding) are called, so the numerics
are the model's; only the attention is spelled out in plain MatMul/Softmax, which NPU compilers take.
"""

from __future__ import annotations

import torch
from torch import nn



SUPPORTED = ("llama", "qwen2")


def check_supported(config) -> None:
    from mirrorsd.errors import ExportError

    if config.model_type not in SUPPORTED:
        raise ExportError(f"exporting {config.model_type!r} models is not supported",
                          f"export a model of the {' / '.join(SUPPORTED)} families (e.g. smollm2-135m, "
                          "qwen2.5-coder-0.5b)")


def model_dims(config) -> dict:
    """Layer count, kv heads, head size, vocab: what the host needs to hold the cache."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {"layers": int(config.num_hidden_layers), "kv_heads": int(config.num_key_value_heads),
            "heads": int(config.num_attention_heads), "head_dim": int(head_dim),
            "hidden": int(config.hidden_size), "vocab": int(config.vocab_size)}


class ExplicitCacheDecoder(nn.Module):
    """spare_row: compute one more row than the block, a copy of its last one, and drop it (the batch-invariant
    graph of a verifier). ONNX Runtime's CPU matmuls give a row the same bits for any row count from 2 up but run
    a single row through another kernel; with the spare row no matmul ever sees one, so each position of a
    verify pass gets exactly the logits of one-token decoding (docs/exactness.md)."""

    def __init__(self, model, spare_row: bool = False) -> None:
        super().__init__()
        self.spare_row = spare_row
        cfg = model.config
        check_supported(cfg)
        self.model = model.eval()
        self.dims = model_dims(cfg)
        self.groups = self.dims["heads"] // self.dims["kv_heads"]
        self.scale = self.dims["head_dim"] ** -0.5

    def forward(self, input_ids, position_ids, attention_mask, *past):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        inner = self.model.model
        d, nkv, nh = self.dims["head_dim"], self.dims["kv_heads"], self.dims["heads"]
        t = input_ids.shape[1]
        if self.spare_row:  # T + 1 rows from here on: the copy of row T - 1 is computed alongside and dropped
            input_ids = torch.cat([input_ids, input_ids[:, -1:]], dim=1)
            position_ids = torch.cat([position_ids, position_ids[:, -1:]], dim=1)
            attention_mask = torch.cat([attention_mask, attention_mask[:, :, -1:]], dim=2)
        rows = input_ids.shape[1]
        h = inner.embed_tokens(input_ids)  # [1, rows, hidden]
        cos, sin = inner.rotary_emb(h, position_ids)  # [1, rows, d]
        new_kv = []
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(1, rows, nh, d).transpose(1, 2)  # [1, nh, rows, d]
            k = attn.k_proj(x).view(1, rows, nkv, d).transpose(1, 2)  # [1, nkv, rows, d]
            v = attn.v_proj(x).view(1, rows, nkv, d).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k, v = k[:, :, :t], v[:, :, :t]  # the spare row adds no cache entry: it attends as row T - 1 does
            new_kv += [k, v]
            keys = torch.cat([past[2 * i], k], dim=2)  # [1, nkv, P + T, d]
            values = torch.cat([past[2 * i + 1], v], dim=2)
            if self.groups > 1:
                keys = keys.repeat_interleave(self.groups, dim=1)  # [1, nh, P + T, d]
                values = values.repeat_interleave(self.groups, dim=1)
            scores = torch.matmul(q, keys.transpose(2, 3)) * self.scale + attention_mask  # [1, nh, T, P + T]
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            out = torch.matmul(probs, values).transpose(1, 2).reshape(1, rows, nh * d)
            h = h + attn.o_proj(out)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = self.model.lm_head(inner.norm(h))[:, :t]  # [1, T, V]; dropped after the head, a matmul too
        return (logits, *new_kv)


