"""The static-shape torch backend: every pass after the cache is set up runs exactly P query rows over one
static KV cache, so a verify pass gives each position bit for bit the logits of one-token decoding, on a GPU
as on the CPU, and the pass can be replayed as a CUDA graph.

Why it is exact: a kernel's reduction order depends on the shapes it is given (cuBLAS and the attention
kernels pick their tiling, split-K and code path by them), not on the values in the other rows. Here every
matmul sees M = P rows and every attention call P query rows over the whole static cache, whatever the number
of real tokens: a decode step is one real row and P - 1 pad rows, a verify pass K + 1 real rows and pads,
a prompt is fed P rows at a time. A position's row therefore goes through the very same arithmetic whichever
pass computes it, and so do the keys and values it leaves in the cache. The invariance check
(runtime/backends/invariance.py) confirms it on the device before `exact_batches` is declared.

Why pads are harmless: real rows come first and pad rows write cache cells past the last real token. Within
each layer a pass writes all its keys and values before attending, and a row at position p attends to cells
0..p only (a mask over the static cache), so it sees committed tokens and the real rows before it, never a pad;
a later pass overwrites the pad cells before any row can see them.

Why CUDA graphs (torch.cuda.CUDAGraph) rather than torch.compile: on a GPU an eager step of a small model is
bound by kernel launches, and a captured graph replays the same kernels, with the same numerics as the eager
forward the CPU tests run, with one launch; capture takes seconds where compiling a model takes minutes, and
it needs no Triton. One graph per row count, captured at load.

Supports the Llama / Qwen2 / Mistral families (plain causal attention, RoPE). A draft model, whose rows need
no exactness, runs one-row steps (P = 1) and takes its prompt in wider chunks (`prefill_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from mirrorsd.errors import ConfigError
from mirrorsd.runtime.backends.base import PrefixCachedLM
from mirrorsd.runtime.backends.invariance import FIXED_ROWS as DEFAULT_ROWS, check_fixed_shape


FAMILIES = frozenset({"llama", "qwen2", "mistral"})
DEFAULT_CONTEXT = 4096  # cells in the static cache (as llama.cpp's default context); every pass attends over all
CELL_ALIGN = 256  # cache length rounded up to this (attention kernels want aligned key counts)


def supports(model: PreTrainedModel) -> bool:
    """Whether the static-shape forward applies: a plain-attention decoder of a supported family."""
    cfg, rope = model.config, getattr(model.get_decoder(), "rotary_emb", None)
    # dynamic and longrope RoPE rescale by the largest position in a pass, which a pad row would move
    return (getattr(cfg, "model_type", None) in FAMILIES and not set(getattr(cfg, "layer_types", None) or [])
            - {"full_attention"} and rope is not None
            and not any(kind in str(getattr(rope, "rope_type", "")) for kind in ("dynamic", "longrope")))


class StaticTorchLM(PrefixCachedLM):
    """CausalLM on torch with a static KV cache and fixed-shape passes (module docstring).

    rows: P, the query rows of every pass. prefill_rows: a wider shape for prompt tokens whose logits are not
    returned (None: prompts also go P rows at a time, which every exact target needs). max_context: cells of
    the static cache (default min(the model's limit, 4096)). graphs: capture CUDA graphs (default: on CUDA).
    exact_batches: the invariance check's verdict when already known (a cache); None runs the check now."""

    early_exit = None  # a captured graph cannot publish mid-pass
    threads = None

    def __init__(self, model: PreTrainedModel, device: torch.device | str | None = None, *, rows: int = DEFAULT_ROWS,
                 prefill_rows: int | None = None, max_context: int | None = None, graphs: bool | None = None,
                 exact_batches: bool | None = None) -> None:
        super().__init__()
        if not supports(model):
            raise ConfigError(f"the static-shape torch backend runs Llama, Qwen2 and Mistral models, not "
                              f"{getattr(model.config, 'model_type', type(model).__name__)!r}",
                              "use --backend torch on the CPU, or --backend llamacpp")
        if rows < 1 or (prefill_rows is not None and prefill_rows < rows):
            raise ValueError(f"rows must be >= 1 and prefill_rows >= rows, got {rows} and {prefill_rows}")
        self.model = model.eval()
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        if next(model.parameters()).device != self.device:
            self.model.to(self.device)
        cfg = model.config
        self.rows, self.prefill_rows = rows, prefill_rows
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        limit = int(getattr(cfg, "max_position_embeddings", 0) or DEFAULT_CONTEXT)
        sliding = getattr(cfg, "sliding_window", None)
        if sliding and getattr(cfg, "use_sliding_window", True):
            limit = min(limit, int(sliding))  # full attention equals sliding-window attention up to the window
        self.max_context = min(limit, max_context or DEFAULT_CONTEXT)
        self.dtype = next(model.parameters()).dtype
        self.computes_on = "cpu" if self.device.type == "cpu" else "gpu"
        self.backend = f"torch-static:{self.device.type}"
        self._decoder = model.get_decoder()  # embeddings, RoPE, layers, final norm
        self._layers = list(self._decoder.layers)
        attn = self._layers[0].self_attn
        self._heads = int(cfg.num_attention_heads)
        self._kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self._heads)
        self._head_dim = int(attn.head_dim)
        self._scale = float(attn.scaling)
        widest = max(rows, prefill_rows or 0)
        cells = -(-(self.max_context + widest) // CELL_ALIGN) * CELL_ALIGN  # room for the pads past the limit
        with torch.no_grad():
            shape = (1, self._kv_heads, cells, self._head_dim)
            self._k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self._layers]
            self._v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self._layers]
            self._cells = torch.arange(cells, device=self.device)
        self._passes = {n: _Pass(self, n, graphs) for n in {rows, prefill_rows or rows}}
        self.graphed = any(p.graph is not None for p in self._passes.values())
        self.exact_batches = (prefill_rows is None and check_fixed_shape(self, self.rows)) if exact_batches is None else exact_batches

    # -- one fixed-shape pass ----------------------------------------------------------------------

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """ids [1, n], pos [n] (the cache cells they take): writes their keys/values, returns logits [n, V].
        Tensor operations only, no host synchronisation: it is what a CUDA graph captures."""
        n, group = ids.shape[1], self._heads // self._kv_heads
        x = self._decoder.embed_tokens(ids)  # [1, n, hidden]
        cos, sin = self._decoder.rotary_emb(x, pos[None])  # [1, n, D] each
        cos, sin = cos[:, None], sin[:, None]  # [1, 1, n, D]
        # row g*n + i of a key-value head's query block is query head (kv * group + g) at position i
        mask = (self._cells[None, :] <= pos[:, None]).repeat(group, 1)  # [group * n, cells]
        for layer, k_cache, v_cache in zip(self._layers, self._k, self._v):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(1, n, self._heads, self._head_dim).transpose(1, 2)  # [1, H, n, D]
            k = attn.k_proj(h).view(1, n, self._kv_heads, self._head_dim).transpose(1, 2)  # [1, Hkv, n, D]
            v = attn.v_proj(h).view(1, n, self._kv_heads, self._head_dim).transpose(1, 2)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            k_cache.index_copy_(2, pos, k)
            v_cache.index_copy_(2, pos, v)
            q = q.reshape(1, self._kv_heads, group * n, self._head_dim)  # grouped heads as extra query rows
            o = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, scale=self._scale)
            o = o.view(1, self._heads, n, self._head_dim).transpose(1, 2).reshape(1, n, -1)  # [1, n, H * D]
            x = x + attn.o_proj(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.get_output_embeddings()(self._decoder.norm(x))[0]  # [n, V]

    # -- CausalLM ----------------------------------------------------------------------------------

    def _feed(self, new: list[int], rows: int) -> torch.Tensor:
        """Feed `new` in fixed-shape passes; the tokens before the last `rows` may go in prefill_rows chunks."""
        start, out = len(self._cached), []
        head = max(0, len(new) - rows) if self.prefill_rows else 0
        wide = self._passes[self.prefill_rows or self.rows]
        for i in range(0, head - head % wide.n, wide.n):  # whole wide chunks of the prompt; logits unused
            if i:
                self.check_cancel()  # a long prompt stops within a chunk of its client leaving
            wide.run(new[i:i + wide.n], start + i)
        done = head - head % wide.n
        step = self._passes[self.rows]
        for i in range(done, len(new), step.n):
            if i and i < len(new) - rows:
                self.check_cancel()  # still in the prompt: a long one stops within a pass of its client leaving
            logits = step.run(new[i:i + step.n], start + i)
            first = max(0, len(new) - rows - i)  # rows of this chunk that are wanted
            if first < logits.shape[0]:
                out.append(logits[first:].to(torch.float32, copy=True))
        self._cached.extend(new)
        return torch.cat(out) if len(out) > 1 else out[0]  # [rows, V]

    def _drop(self, length: int) -> None:
        """Nothing to free: cells past `length` are masked from every row until a pass overwrites them."""

    def cache_cells(self, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The keys and values of the first `length` cells, per layer, each [Hkv, length, D] (for the tests)."""
        return [k[0, :, :length].clone() for k in self._k], [v[0, :, :length].clone() for v in self._v]

    def close(self) -> None:
        self.reset()
        self._passes.clear()
        self._k, self._v = [], []
        self.model = None


class _Pass:
    """One fixed shape: `n` query rows, captured as a CUDA graph where asked (default: on CUDA)."""

    def __init__(self, lm: StaticTorchLM, n: int, graphs: bool | None) -> None:
        self.lm, self.n = lm, n
        self.ids = torch.zeros((1, n), dtype=torch.long, device=lm.device)
        self.pos = torch.arange(n, device=lm.device)
        self.graph = self._capture() if (lm.device.type == "cuda" if graphs is None else graphs) else None

    @torch.no_grad()
    def _capture(self) -> torch.cuda.CUDAGraph:
        side = torch.cuda.Stream(self.lm.device)
        side.wait_stream(torch.cuda.current_stream(self.lm.device))
        with torch.cuda.stream(side):  # warm-up passes (allocator and library handles) outside the capture
            for _ in range(2):
                self.lm.forward(self.ids, self.pos)
        torch.cuda.current_stream(self.lm.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits = self.lm.forward(self.ids, self.pos)  # [n, V], rewritten by every replay
        return graph

    @torch.no_grad()
    def run(self, tokens: Sequence[int], start: int) -> torch.Tensor:
        """Logits [len(tokens), V] (a view valid until the next pass) of tokens at cells start.. (pads after)."""
        real = len(tokens)
        padded = torch.tensor(list(tokens) + [0] * (self.n - real), dtype=torch.long)
        self.ids[0].copy_(padded)
        self.pos.copy_(torch.arange(start, start + self.n))
        if self.graph is None:
            return self.lm.forward(self.ids, self.pos)[:real]
        self.graph.replay()
        return self.logits[:real]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
