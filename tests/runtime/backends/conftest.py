import pytest
import torch


@pytest.fixture(scope="module")
def invariance_llama():
    """A random float32 Llama with widths K-quants' 256-wide blocks divide and repacking's 8-row groups fit,
    for the batch-invariance checks (tests copy it before changing it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    return LlamaForCausalLM(cfg).eval()
