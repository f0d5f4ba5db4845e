"""Tiny GGUF files written in the test run with the `gguf` package (no hub, no converter script): the
tiny random Llama of conftest, its weights laid out as llama.cpp reads them."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotary layout -> llama.cpp's (as llama.cpp's convert_hf_to_gguf.py does for q and k)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(model, path: Path, quant: str = "F32") -> Path:
    """The transformers LlamaForCausalLM `model` as a GGUF file (no tokenizer inside: "no_vocab", the
    vocabulary size only; mirrorsd brings the tokenizer). quant: "F32" or "Q8_0" for the matrices."""
    import gguf

    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]))
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_tokenizer_model("no_vocab")
    kind = gguf.GGMLQuantizationType[quant]

    def add(name: str, w: np.ndarray, matrix: bool = True) -> None:
        if matrix and kind != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"], matrix=False)
        add(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads))
        add(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads))
        add(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        add(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        add(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"], matrix=False)
        add(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        add(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        add(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    add("output_norm.weight", sd["model.norm.weight"], matrix=False)
    add("output.weight", sd["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantize_gguf(src: Path, dst: Path, ftype: str = "Q4_K_M") -> Path:
    """llama.cpp's own quantizer (llama_model_quantize, as `llama-quantize` runs it) on a GGUF file:
    real Q4_K / Q6_K / ... blocks, with llama.cpp's choice of type per tensor."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize failed on {src}")
    return dst


def load_gguf_weights(model, path: Path):
    """`model` (the LlamaForCausalLM a write_llama_gguf file came from) with the file's weights,
    dequantized as transformers dequantizes a GGUF (gguf-py), q and k back in HF's rotary layout."""
    import gguf
    import torch

    cfg = model.config
    hf = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight"}
    per_layer = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                 "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
                 "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    state = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        if t.name.startswith("blk."):
            _, i, part, _ = t.name.split(".")
            if part == "attn_q":
                w = _unpermute(w, cfg.num_attention_heads)
            elif part == "attn_k":
                w = _unpermute(w, cfg.num_key_value_heads)
            state[f"model.layers.{i}.{per_layer[part]}.weight"] = torch.from_numpy(np.array(w, dtype=np.float32))
        else:
            state[hf[t.name]] = torch.from_numpy(np.array(w, dtype=np.float32))
    model.load_state_dict(state, strict=False)
    return model
