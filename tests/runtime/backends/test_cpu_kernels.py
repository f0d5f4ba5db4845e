"""oneDNN float32 linear layers (runtime/cpu_kernels.py): same weights and state dict, logits equal to the
default kernel up to float32 rounding, and speculative decoding over switched models still returns
exactly what target-only decoding over them returns, in every pipeline mode."""

from __future__ import annotations

import pytest
import torch

from conftest import make_model
from mirrorsd import Engine, GenerationConfig
from mirrorsd.runtime.backends.cpu_kernels import ENV, OneDNNLinear, onednn_linear_available, use_onednn_linear
from mirrorsd.runtime.drafters import NGramDrafter, ModelDrafter
from mirrorsd.runtime.backends.torch_lm import TorchCausalLM
from helpers import PROMPTS

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="this torch build has no usable oneDNN")


def test_switch_keeps_weights_and_matches_the_default_kernel(tokenizer):
    plain, switched = make_model(tokenizer, seed=0, sharpness=30.0), make_model(tokenizer, seed=0, sharpness=30.0)
    n = use_onednn_linear(switched)
    linears = [m for m in switched.modules() if isinstance(m, torch.nn.Linear)]
    assert n == len(linears) > 0 and all(type(m) is OneDNNLinear for m in linears)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), switched.state_dict().values()))
    ids = torch.tensor([list(range(3, 40))])
    with torch.inference_mode():
        want, got = plain(ids).logits, switched(ids).logits
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)
    assert use_onednn_linear(switched) == 0  # already switched: nothing left to do


def test_turned_off_by_the_environment(tokenizer, monkeypatch):
    monkeypatch.setenv(ENV, "default")
    model = make_model(tokenizer, seed=0)
    assert use_onednn_linear(model) == 0
    assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize("mode", ["off", "overlap", "branches"])
def test_speculative_over_switched_models_equals_target_only(mode, tokenizer):
    target, draft = make_model(tokenizer, seed=0, sharpness=30.0), make_model(tokenizer, seed=1, sharpness=30.0)
    use_onednn_linear(target), use_onednn_linear(draft)
    plain = Engine(target, tokenizer, None)
    plain.eos_ids = frozenset()
    spec = Engine(target, tokenizer, ModelDrafter(TorchCausalLM(draft)), helper=NGramDrafter())
    spec.eos_ids = frozenset()
    for prompt in PROMPTS:
        want = plain.generate(prompt, GenerationConfig(max_new_tokens=30)).token_ids
        got = spec.generate(prompt, GenerationConfig(max_new_tokens=30, num_draft_tokens=4, pipeline=mode,
                                                     early_exit_layer=1))
        assert got.token_ids == want, (mode, prompt)
        assert got.stats.drafted_tokens > got.stats.accepted_tokens  # rejections: rollback ran
