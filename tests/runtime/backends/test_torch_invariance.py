"""The torch backend's batch-invariant CPU kernels (runtime/backends/torch_invariant.py): in float32 on the
CPU every row of a verify pass of 1..17 positions equals one-token decoding bit for bit, at offsets past 256
and after chunked prefills; without them the same check fails, so it can tell; where they do not apply
(bfloat16) the backend declares its passes inexact."""

from __future__ import annotations

import copy

import pytest
import torch

from mirrorsd.runtime.backends.invariance import check_batch_invariance
from mirrorsd.runtime.backends.cpu_kernels import onednn_linear_available
from mirrorsd.runtime.backends.torch_lm import TorchCausalLM

TOKENS = [(i * 7919 + 13) % 1000 for i in range(300)]

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="the exact kernels are oneDNN's")


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    return LlamaForCausalLM(cfg).eval()


def test_every_row_of_a_verify_pass_equals_one_token_decoding(llama):
    lm = TorchCausalLM(copy.deepcopy(llama), "cpu")
    assert lm.exact_batches
    report = check_batch_invariance(lm, TOKENS, offsets=(9, 280))
    assert report.exact, report.summary()


def test_the_default_kernels_fail_the_same_check(llama):
    lm = TorchCausalLM(copy.deepcopy(llama), "cpu", batch_invariant=False)
    assert not lm.exact_batches
    report = check_batch_invariance(lm, TOKENS, offsets=(9,), sizes=(1, 4, 9))
    assert not report.exact and report.max_abs_diff < 1e-3, report.summary()


def test_bfloat16_is_declared_inexact(llama):
    lm = TorchCausalLM(copy.deepcopy(llama).to(torch.bfloat16), "cpu")
    assert not lm.exact_batches and lm.model.config._attn_implementation != "mirrorsd_rowwise"


@pytest.mark.integration
def test_smollm2_in_float32_is_batch_invariant():
    from mirrorsd.runtime.backends import load_lm

    loaded = load_lm("smollm2-135m", backend="torch", device="cpu")
    assert loaded.lm.exact_batches
    prompt = loaded.tokenizer.encode("Write a Python function that reverses a string.")
    report = check_batch_invariance(loaded.lm, prompt, offsets=(len(prompt),), sizes=(1, 2, 5, 9, 17))
    assert report.exact, report.summary()
