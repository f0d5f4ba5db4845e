"""The torch backend's batch-invariant CPU kernels (runtime/backends/torch_invariant.py): in float32 on the
CPU every row of a verify pass of 1..17 positions equals one-token decoding bit for bit, at offsets past 256
and after chunked prefills; without them the same check fails, so it can tell; where they do not apply
(bfloat16) the backend declares its passes inexact."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import invariance_tokens
from mirrorsd.runtime.backends.invariance import check_batch_invariance
from mirrorsd.runtime.backends.cpu_kernels import onednn_linear_available
from mirrorsd.runtime.backends.torch_invariant import make_batch_invariant
from mirrorsd.runtime.backends.torch_lm import TorchCausalLM

TOKENS = invariance_tokens(1000, 300)

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="the exact kernels are oneDNN's")


def switched(model):
    assert make_batch_invariant(model)
    return model


def test_every_row_of_a_verify_pass_equals_one_token_decoding(invariance_llama):
    lm = TorchCausalLM(switched(copy.deepcopy(invariance_llama)), "cpu")
    assert lm.exact_batches
    report = check_batch_invariance(lm, TOKENS, offsets=(9, 280))
    assert report.exact, report.summary()


def test_the_default_kernels_fail_the_same_check(invariance_llama):
    lm = TorchCausalLM(copy.deepcopy(invariance_llama), "cpu")  # handed in as it is: its own kernels, declared inexact
    assert not lm.exact_batches
    report = check_batch_invariance(lm, TOKENS, offsets=(9,), sizes=(1, 4, 9))
    assert not report.exact and report.max_abs_diff < 1e-3, report.summary()


def test_bfloat16_is_declared_inexact(invariance_llama):
    model = copy.deepcopy(invariance_llama).to(torch.bfloat16)
    assert not make_batch_invariant(model)
    lm = TorchCausalLM(model, "cpu")
    assert not lm.exact_batches and lm.model.config._attn_implementation != "mirrorsd_rowwise"


def test_a_switched_model_moved_to_bfloat16_is_declared_inexact(invariance_llama):
    lm = TorchCausalLM(switched(copy.deepcopy(invariance_llama)).to(torch.bfloat16), "cpu")
    assert not lm.exact_batches


def test_building_the_backend_leaves_the_model_as_it_was(invariance_llama):
    model = copy.deepcopy(invariance_llama)
    TorchCausalLM(model, "cpu")
    assert model.config._attn_implementation != "mirrorsd_rowwise"
    assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.integration
def test_smollm2_in_float32_is_batch_invariant():
    from mirrorsd.runtime.backends import load_lm

    loaded = load_lm("smollm2-135m", backend="torch", device="cpu")
    assert loaded.lm.exact_batches
    prompt = loaded.tokenizer.encode("Write a Python function that reverses a string.")
    report = check_batch_invariance(loaded.lm, prompt, offsets=(len(prompt),), sizes=(1, 2, 5, 9, 17))
    assert report.exact, report.summary()


def test_a_model_drafting_for_itself_has_every_token_accepted(target_model, tokenizer):
    from mirrorsd import Engine, GenerationConfig
    from mirrorsd.runtime.drafters import ModelDrafter

    engine = Engine(switched(copy.deepcopy(target_model)), tokenizer)
    engine.eos_ids = frozenset()
    assert engine.target.exact_batches
    spec = engine.with_drafter(ModelDrafter(TorchCausalLM(switched(copy.deepcopy(target_model)))), helper=None)
    for pipeline in ("off", "overlap", "branches"):
        for prompt in ("def quicksort(arr):\n    if len(arr) <= 1:", "The quick brown fox"):
            want = engine.generate(prompt, GenerationConfig(max_new_tokens=32)).token_ids
            result = spec.generate(prompt, GenerationConfig(max_new_tokens=32, num_draft_tokens=4, pipeline=pipeline))
            assert result.token_ids == want, (pipeline, prompt)
            assert result.stats.accepted_tokens == result.stats.drafted_tokens > 0, (pipeline, prompt)
