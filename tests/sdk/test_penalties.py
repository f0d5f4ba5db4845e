"""OpenAI's presence and frequency penalties: the formula (generated tokens only, as vLLM), applied the same
in target-only decoding and in verify, so speculation keeps greedy output and the sampled distribution."""

from __future__ import annotations

import pytest
import torch

from helpers import PROMPTS, assert_distribution, exact_first_two
from mirrorsd import Engine, GenerationConfig
from mirrorsd.config import SamplingParams
from mirrorsd.runtime.backends.torch_lm import TorchCausalLM
from mirrorsd.runtime.drafters import ModelDrafter, NGramDrafter
from mirrorsd.runtime.decode.sampling import next_token_scores


def test_the_penalties_follow_openais_formula_over_generated_tokens_only():
    logits = torch.randn(3, 10)
    history, prompt_len, draft = [1, 1, 2, 5, 5, 5, 7], 3, [7, 9]  # generated: 5 5 5 7, then the draft
    cfg = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    got = next_token_scores(logits, cfg, history, draft, prompt_len)
    for i in range(3):
        seen = history[prompt_len:] + draft[:i]
        want = logits[i].clone()
        for t in set(seen):
            want[t] -= 0.25 * seen.count(t) + 0.5
        assert torch.allclose(got[i], want), i
    assert torch.equal(next_token_scores(logits, SamplingParams(), history, draft, prompt_len), logits)


@pytest.mark.parametrize("mode", ["off", "overlap", "branches"])
def test_speculation_with_penalties_is_token_equal_to_target_only(mode, target_model, other_model, tokenizer):
    cfg = GenerationConfig(max_new_tokens=30, num_draft_tokens=3, presence_penalty=0.7, frequency_penalty=0.4,
                           pipeline=mode)
    plain = Engine(target_model, tokenizer, None)
    plain.eos_ids = frozenset()
    for drafter in (NGramDrafter(), ModelDrafter(TorchCausalLM(target_model))):
        engine = Engine(target_model, tokenizer, drafter, helper=None)
        engine.eos_ids = frozenset()
        for prompt in PROMPTS:
            result = engine.generate(prompt, cfg)
            assert result.token_ids == plain.generate(prompt, cfg).token_ids
    assert plain.generate(PROMPTS[0], cfg).token_ids != plain.generate(PROMPTS[0], max_new_tokens=30).token_ids


@pytest.mark.slow  # a statistical test: thousands of sampled runs
def test_sampling_with_penalties_follows_the_penalised_target(target_model, other_model, tokenizer):
    cfg = GenerationConfig(temperature=0.8, max_new_tokens=2, num_draft_tokens=2, adaptive_k=False,
                           presence_penalty=1.5, frequency_penalty=1.0)
    engine = Engine(target_model, tokenizer, ModelDrafter(TorchCausalLM(other_model)), helper=None)
    engine.eos_ids = frozenset()
    p1, p2 = exact_first_two(target_model, tokenizer, cfg, PROMPTS[1])
    assert_distribution(engine, PROMPTS[1], cfg, p1, p2, seeds=1200, min_drafted=800)
