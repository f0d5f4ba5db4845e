"""Structured output (mirrorsd/structured.py): every reply follows its schema, speculation composes with the
grammar (greedy token-equal to constrained target-only decoding, itself checked against a plain loop over the
model and llguidance's own masks; sampling in distribution), and bad grammars are clear errors."""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch

from helpers import PROMPTS, assert_distribution, exact_first_two
from mirrorsd import Engine, GenerationConfig
from mirrorsd.errors import ConfigError
from mirrorsd.runtime.backends.torch_lm import TorchCausalLM
from mirrorsd.runtime.drafters import ModelDrafter, NGramDrafter
from mirrorsd.runtime.decode.sampling import next_token_scores
from mirrorsd.runtime.decode.grammar import apply_masks
from mirrorsd.structured import JSON_LAYOUT

# Bounded, so that even a random tiny model completes it within the token budget.
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "fast": {"type": "boolean"},
                   "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                              "maxItems": 3}},
    "required": ["name", "fast", "tokens"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}


def engines(target_model, other_model, tokenizer):
    yield Engine(target_model, tokenizer, None)  # constrained target-only: the reference
    for drafter in (NGramDrafter(), ModelDrafter(TorchCausalLM(target_model)), ModelDrafter(TorchCausalLM(other_model))):
        yield Engine(target_model, tokenizer, drafter, helper=None)


def plain_constrained_greedy(model, tokenizer, prompt: str, schema: dict, n: int) -> list[int]:
    """Constrained greedy decoding written out: full forward pass, llguidance's mask, argmax, consume."""
    from llguidance.numpy import allocate_token_bitmask, apply_token_bitmask_inplace, fill_next_token_bitmask

    vocab = model.config.vocab_size
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=tokenizer.eos_token_id)
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT),
                                  log_level=0)
    ids, out, bits = tokenizer(prompt)["input_ids"], [], allocate_token_bitmask(1, vocab)
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids + out])).logits[0, -1:].numpy().copy()  # [1, V]
        fill_next_token_bitmask(matcher, bits)
        apply_token_bitmask_inplace(logits, bits)
        out.append(int(logits.argmax()))
        if out[-1] == tokenizer.eos_token_id:
            break
        assert matcher.consume_token(out[-1])
    return out


@pytest.mark.parametrize("mode", ["off", "overlap", "branches"])
def test_greedy_structured_output_is_valid_and_token_equal_to_constrained_target_only(
        mode, target_model, other_model, tokenizer):
    cfg = GenerationConfig(max_new_tokens=60, num_draft_tokens=4, json_schema=SCHEMA, pipeline=mode)
    reference, *speculative = engines(target_model, other_model, tokenizer)
    drafted = 0
    for prompt in PROMPTS:
        want = reference.generate(prompt, cfg)
        assert want.finish_reason == "stop", want.text
        jsonschema.validate(json.loads(want.text), SCHEMA)
        for engine in speculative:
            got = engine.generate(prompt, cfg)
            assert got.token_ids == want.token_ids, (engine.drafter, prompt)
            drafted += got.stats.drafted_tokens
    assert drafted > 50  # the drafters really drafted (and were clipped where the grammar forbade)


def test_constrained_target_only_matches_a_plain_constrained_loop(target_model, tokenizer):
    engine = Engine(target_model, tokenizer, None)
    for prompt in PROMPTS:
        got = engine.generate(prompt, max_new_tokens=60, json_schema=SCHEMA).token_ids
        assert got == plain_constrained_greedy(target_model, tokenizer, prompt, SCHEMA, 60)
    unconstrained = engine.generate(PROMPTS[0], max_new_tokens=20).text
    with pytest.raises(json.JSONDecodeError):  # without the grammar this model writes no JSON
        json.loads(unconstrained)


def test_regex_and_lark_grammars_constrain_every_mode(target_model, tokenizer):
    engine = Engine(target_model, tokenizer, ModelDrafter(TorchCausalLM(target_model)), helper=None)
    for mode in ("off", "overlap"):
        text = engine.generate(PROMPTS[1], max_new_tokens=30, regex=r"[0-9]{3}-[0-9]{4}", pipeline=mode).text
        assert len(text) == 8 and text[3] == "-" and (text[:3] + text[4:]).isdigit(), text
        lark = 'start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[0-9]/'
        assert engine.generate(PROMPTS[2], max_new_tokens=10, grammar=lark, pipeline=mode).text in (
            ["yes", "no"] + [f"maybe {d}" for d in range(10)])


def exact_first_two_constrained(engine, model, tokenizer, cfg, prompt):
    """Exact P(t1) and marginal P(t2) of constrained target-only sampling, from the model's logits and
    the grammar's masks."""
    ids = tokenizer(prompt)["input_ids"]
    first = engine.constraint(cfg)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1:]
        p1 = next_token_scores(apply_masks(logits, first.masks([])), cfg.sampling, ids, prompt_len=len(ids))[0]
        p1 = p1.double().numpy()
        p2 = np.zeros_like(p1)
        for t in np.nonzero(p1)[0]:
            state = engine.constraint(cfg)
            state.advance([int(t)])
            row = model(torch.tensor([ids + [int(t)]])).logits[0, -1:]
            p2 += p1[t] * next_token_scores(apply_masks(row, state.masks([])), cfg.sampling, ids + [int(t)],
                                            prompt_len=len(ids))[0].double().numpy()
    return p1, p2


@pytest.mark.slow  # a statistical test: thousands of sampled runs
def test_sampling_under_a_grammar_follows_the_constrained_target(target_model, tokenizer):
    cfg = GenerationConfig(temperature=1.0, max_new_tokens=2, num_draft_tokens=2, adaptive_k=False,
                           regex=r"[^0-9.]{2,20}")
    # The target drafting for itself unconstrained: its drafts are often forbidden, and its q is not the
    # constrained p, so both clipping and the accept/residual arithmetic are exercised.
    engine = Engine(target_model, tokenizer, ModelDrafter(TorchCausalLM(target_model)), helper=None)
    engine.eos_ids = frozenset()
    p1, p2 = exact_first_two_constrained(engine, target_model, tokenizer, cfg, PROMPTS[1])
    free, _ = exact_first_two(target_model, tokenizer, replace(cfg, regex=None), PROMPTS[1])
    assert np.abs(free - p1).sum() > 0.1  # the grammar moves the distribution: the test can tell them apart
    assert_distribution(engine, PROMPTS[1], cfg, p1, p2, seeds=800, min_drafted=500)


@pytest.mark.parametrize("settings, message", [
    ({"json_schema": "{not json"}, "not valid JSON"),
    ({"json_schema": [1, 2]}, "must be a JSON object"),
    ({"json_schema": {"type": "object"}, "regex": "a+"}, "at most one"),
    ({"logprobs": 21}, "logprobs must be in"),
])
def test_bad_structure_settings_are_config_errors(settings, message):
    with pytest.raises(ConfigError, match=message):
        GenerationConfig(**settings)


@pytest.mark.parametrize("settings", [{"regex": "(unclosed"}, {"grammar": "start: missing_rule"},
                                      {"json_schema": {"type": "no-such-type"}}])
def test_an_invalid_grammar_is_refused_before_any_token(settings, target_model, tokenizer):
    engine = Engine(target_model, tokenizer, NGramDrafter(), helper=None)
    with pytest.raises(ConfigError, match="grammar is invalid"):
        engine.stream(PROMPTS[0], max_new_tokens=5, **settings)
    assert engine.generate(PROMPTS[0], max_new_tokens=5).token_ids  # the engine serves on


def test_logprobs_are_the_targets_whatever_drafted_them(target_model, other_model, tokenizer):
    cfg = GenerationConfig(max_new_tokens=12, logprobs=3)
    results = [engine.generate(PROMPTS[0], cfg) for engine in engines(target_model, other_model, tokenizer)]
    ids = tokenizer(PROMPTS[0])["input_ids"]
    with torch.no_grad():
        logp = torch.log_softmax(target_model(torch.tensor([ids + results[0].token_ids])).logits[0], dim=-1)
    for result in results:
        assert result.token_ids == results[0].token_ids
        assert len(result.logprobs) == len(result.token_ids)
        for i, (tok, entry) in enumerate(zip(result.token_ids, result.logprobs)):
            row = logp[len(ids) - 1 + i]
            assert entry.logprob == pytest.approx(row[tok].item(), abs=1e-4)
            assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()
            assert entry.top[0][0] == tok  # greedy: the chosen token is the likeliest
    assert Engine(target_model, tokenizer, None).generate(PROMPTS[0], max_new_tokens=3).logprobs is None


def test_a_draft_ending_the_reply_leaves_the_grammar_state_as_it_was(target_model, tokenizer):
    """Regression: a clipped draft may end with end-of-sequence; the matcher must not consume it (rolling
    llguidance back over EOS corrupted its state, and a later step refused the target's own token)."""
    engine = Engine(target_model, tokenizer, None)
    state = engine.constraint(GenerationConfig(json_schema={"type": "boolean"}))
    eos = tokenizer.eos_token_id
    true = tokenizer("true")["input_ids"]
    start = state.masks([])[0].clone()
    assert state.clip(true + [eos, 5, 6]) == true + [eos]  # nothing after the end
    rows = state.masks(true + [eos])
    assert torch.equal(rows[0], start) and rows[-1].nonzero().flatten().tolist() == [eos]
    assert torch.equal(state.masks([])[0], start)  # back at the committed state
    state.advance(true + [eos])
    assert state.masks([])[0].nonzero().flatten().tolist() == [eos]
