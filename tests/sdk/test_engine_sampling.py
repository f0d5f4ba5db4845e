"""Sampling through the whole engine: the first generated tokens follow the target's distribution,
whatever drafts, and a seed reproduces a run."""

from __future__ import annotations


import pytest

from helpers import assert_distribution, exact_first_two
from mirrorsd import Engine, GenerationConfig
from mirrorsd.runtime.drafters import NGramDrafter, ModelDrafter
from mirrorsd.runtime.backends.torch_lm import TorchCausalLM

PROMPT = "The quick brown fox"


@pytest.mark.slow  # a statistical test: thousands of sampled runs
@pytest.mark.parametrize("drafter_kind,pipeline,min_p", [("other-model", "off", 0.0), ("other-model", "branches", 0.0),
                                                          ("ngram", "off", 0.0), ("ngram", "overlap", 0.0),
                                                          ("other-model", "off", 0.05)])
def test_speculative_sampling_matches_target_distribution(drafter_kind, pipeline, min_p, target_model, other_model,
                                                          tokenizer):
    cfg = GenerationConfig(temperature=0.8, max_new_tokens=2, num_draft_tokens=2, adaptive_k=False,
                           pipeline=pipeline, early_exit_layer=1, min_p=min_p)
    prompt = PROMPT
    if drafter_kind == "other-model":
        drafter = ModelDrafter(TorchCausalLM(other_model))
    else:  # a prompt that repeats itself, so the n-gram drafter proposes at every step
        drafter, prompt = NGramDrafter(), "fox and dog, fox and dog, fox and dog, fox"
    engine = Engine(target_model, tokenizer, drafter)
    engine.eos_ids = frozenset()
    p1, p2 = exact_first_two(target_model, tokenizer, cfg, prompt)
    assert engine.generate(prompt, cfg).stats.pipeline == pipeline
    assert_distribution(engine, prompt, cfg, p1, p2, seeds=2500, min_drafted=1000)


def test_same_seed_same_output_different_seed_different_output(target_model, other_model, tokenizer):
    engine = Engine(target_model, tokenizer, ModelDrafter(TorchCausalLM(other_model)))
    engine.eos_ids = frozenset()
    cfg = GenerationConfig(temperature=1.0, max_new_tokens=30, seed=11)
    a = engine.generate(PROMPT, cfg).token_ids
    b = engine.generate(PROMPT, cfg).token_ids
    c = engine.generate(PROMPT, GenerationConfig(temperature=1.0, max_new_tokens=30, seed=12)).token_ids
    assert a == b and a != c


def test_a_seeded_run_with_n_gram_drafts_gives_target_only_tokens(target_model, tokenizer):
    """One-hot drafts are verified with target-only's own draws: with a seed, drafting changes no token."""
    prompt = "fox and dog, fox and dog, fox and dog, fox"  # repeats itself: the n-gram drafter proposes
    plain, drafting = Engine(target_model, tokenizer), Engine(target_model, tokenizer, NGramDrafter())
    plain.eos_ids = drafting.eos_ids = frozenset()
    accepted = 0
    for seed in range(6):
        cfg = GenerationConfig(temperature=1.0, max_new_tokens=30, seed=seed, adaptive_k=False, num_draft_tokens=3)
        drafted = drafting.generate(prompt, cfg)
        assert drafted.token_ids == plain.generate(prompt, cfg).token_ids, seed
        accepted += drafted.stats.accepted_tokens
    assert accepted > 0
