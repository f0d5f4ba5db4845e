"""Mirror-SD branches measured against their hints: each hinted step records whether its correction was among
the candidates (early exit or the draft's own top-kappa) and whether its branch was ready; the stats add them
up; both candidate sources keep the output token-equal to target-only decoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mirrorsd import Engine, GenerationConfig
from mirrorsd.contracts import HintOutcome, Step
from mirrorsd.errors import ConfigError
from mirrorsd.results import StatsRecorder
from mirrorsd.runtime.backends.torch_lm import TorchCausalLM
from mirrorsd.runtime.decode.pipeline.branches import Hint, plan_branches
from mirrorsd.runtime.drafters import ModelDrafter, NGramDrafter
from drafters_for_tests import RandomTokenDrafter
from helpers import PROMPTS, decode_steps, hf_greedy


@pytest.fixture(scope="module")
def expected(target_model, tokenizer):
    return {p: hf_greedy(target_model, tokenizer, p, 40) for p in PROMPTS}


def hinted_steps(target_model, drafter, tokenizer, prompt, cfg) -> tuple[list[int], list[Step]]:
    ids = tokenizer(prompt)["input_ids"]
    steps = list(decode_steps(TorchCausalLM(target_model), drafter, ids, cfg, cfg.max_new_tokens))
    return ids, steps


@torch.no_grad()
def top_at(model, context: list[int], kappa: int, layer: int | None) -> list[int]:
    """Top-kappa ids predicting the token after `context`: at `layer` through the final norm and LM head
    (the early exit), or the model's own output when layer is None."""
    out = model(torch.tensor([context]), output_hidden_states=True)
    if layer is None:
        logits = out.logits[0, -1]
    else:
        logits = model.lm_head(model.model.norm(out.hidden_states[layer][0, -1]))
    return torch.topk(logits.float(), kappa).indices.tolist()


@pytest.mark.parametrize("source, kappa", [("early_exit", 2), ("draft", 60)])
def test_covered_flags_match_the_known_candidates(source, kappa, target_model, other_model, tokenizer, expected):
    """The early exit's top-2 at layer 1, or the other (unrelated) model's own top-60: recompute each
    rejection's candidates from the context before the rejected token and check the step's covered flag."""
    drafter = ModelDrafter(TorchCausalLM(other_model))
    cfg = GenerationConfig(max_new_tokens=40, num_draft_tokens=3, adaptive_k=False, pipeline="branches",
                           early_exit_layer=1, branch_width=kappa, branch_source=source)
    rejections = covered = 0
    for prompt in PROMPTS:
        ids, steps = hinted_steps(target_model, drafter, tokenizer, prompt, cfg)
        committed = list(ids)
        for step in steps:
            hint = step.hint
            if hint is not None:
                assert hint.branch_source == source and hint.correction == step.tokens[-1]
                if hint.rejected_at is not None:
                    assert hint.rejected_at == step.accepted_tokens < step.drafted_tokens
                    context = committed + step.tokens[:step.accepted_tokens]
                    # the draft's candidates: its own choice (the rejected token) and kappa alternatives
                    model, layer, n = (target_model, 1, kappa) if source == "early_exit" else (other_model, None, kappa + 1)
                    assert hint.covered == (hint.correction in top_at(model, context, n, layer)), (prompt, step)
                    rejections += 1
                    covered += hint.covered
                else:
                    assert step.accepted_tokens == step.drafted_tokens
                assert hint.state in ("ready", "drafting", "queued", "none")
                assert hint.planned is None or 0 <= hint.ready <= hint.planned
            committed += step.tokens
        assert committed[len(ids):] == expected[prompt]
    assert rejections > 0 and 0 < covered < rejections  # both kinds of flag were checked


@pytest.mark.parametrize("source", ["early_exit", "draft"])
def test_coverage_is_one_when_kappa_is_the_vocabulary(source, target_model, other_model, tokenizer, expected):
    engine = Engine(target_model, tokenizer, ModelDrafter(TorchCausalLM(other_model)))
    engine.eos_ids = frozenset()
    cfg = GenerationConfig(max_new_tokens=40, num_draft_tokens=3, adaptive_k=False, pipeline="branches",
                           early_exit_layer=1, branch_width=len(tokenizer), branch_source=source)
    for prompt in PROMPTS:
        result = engine.generate(prompt, cfg)
        assert result.token_ids == expected[prompt]
        s = result.stats
        assert s.branch_source == source and s.hinted_rejections > 0
        assert s.branch_coverage == 1.0 and s.hinted_covered == s.hinted_rejections
        assert sum(s.branch_states.values()) == s.hinted_rejections
        d = s.to_dict()
        for key in ("branch_coverage", "branch_hit_rate", "branches_ready_share", "hinted_rejections",
                    "branch_states", "branch_source"):
            assert key in d
        assert d["branch_coverage"] == 1.0
        assert s.branches_ready_share is None or 0.0 <= s.branches_ready_share <= 1.0


@pytest.mark.parametrize("source", ["auto", "early_exit", "draft"])
@pytest.mark.parametrize("kind", ["self", "other-model", "random", "ngram"])
def test_greedy_equals_target_only_with_either_branch_source(source, kind, target_model, other_model, tokenizer,
                                                             expected):
    drafter = {"self": lambda: ModelDrafter(TorchCausalLM(target_model)),
               "other-model": lambda: ModelDrafter(TorchCausalLM(other_model)),
               "random": lambda: RandomTokenDrafter(len(tokenizer)),
               "ngram": lambda: NGramDrafter(max_ngram=3, min_ngram=1)}[kind]()
    engine = Engine(target_model, tokenizer, drafter)
    engine.eos_ids = frozenset()
    for adaptive in (True, False):
        cfg = GenerationConfig(max_new_tokens=40, num_draft_tokens=4, adaptive_k=adaptive, pipeline="branches",
                               early_exit_layer=1, branch_source=source)
        for prompt in PROMPTS:
            result = engine.generate(prompt, cfg)
            assert result.token_ids == expected[prompt], (source, kind, prompt)
            s = result.stats
            ranking = kind in ("self", "other-model")
            want = "draft" if ranking and source != "early_exit" else "early_exit"
            if source == "draft" and not ranking:  # asked for the draft's candidates, which it cannot give
                assert s.pipeline == "overlap" and s.hinted_steps == 0
            else:
                assert s.pipeline == "branches"
            assert not s.fallbacks
            if s.hinted_steps:
                assert s.branch_source == want
            if kind == "other-model":
                assert s.hinted_steps > 0 and s.branch_hits + s.branch_misses > 0


def test_draft_source_needs_no_early_exit_and_the_early_exit_layer_is_not_checked(target_model, other_model,
                                                                                    tokenizer, expected):
    engine = Engine(target_model, tokenizer, ModelDrafter(TorchCausalLM(other_model)))
    engine.eos_ids = frozenset()
    last = engine.target.early_exit.num_layers
    with pytest.raises(ConfigError):
        engine.pipeline_mode(GenerationConfig(pipeline="branches", early_exit_layer=last, branch_source="early_exit"))
    assert engine.pipeline_mode(GenerationConfig(pipeline="branches", branch_source="draft")) == "branches"
    engine.target.early_exit = None  # a backend without early exit: the draft's candidates still serve
    try:
        assert engine.pipeline_mode(GenerationConfig(pipeline="branches", branch_source="early_exit")) == "overlap"
        cfg = GenerationConfig(max_new_tokens=40, num_draft_tokens=3, pipeline="branches", early_exit_layer=last)
        assert engine.pipeline_mode(cfg) == "branches"
        result = engine.generate(PROMPTS[0], cfg)
        assert result.token_ids == expected[PROMPTS[0]] and result.stats.branch_source == "draft"
    finally:
        engine.target.early_exit = engine.target
    with pytest.raises(ConfigError, match="branch_source"):
        GenerationConfig(branch_source="target")


def test_model_drafter_ranks_the_distribution_it_drafts_from(target_model, tokenizer):
    drafter = ModelDrafter(TorchCausalLM(target_model))
    assert drafter.model.ranking is drafter and NGramDrafter().model is None
    ids = tokenizer(PROMPTS[0])["input_ids"]
    for cfg in (GenerationConfig(), GenerationConfig(temperature=0.8, seed=1)):
        drafter.start(cfg)
        ranked = list(drafter.propose_ranked(ids, 4, 5))
        drafter.start(cfg)
        assert [(t, None if q is None else q.tolist()) for t, q, _, _ in ranked] == [
            (t, None if q is None else q.tolist()) for t, q in drafter.propose_iter(ids, 4)]
        for token, q, top, logp in ranked:
            assert top.shape == logp.shape == (5,) and np.all(np.diff(logp) <= 0)
            assert np.exp(logp).sum() <= 1 + 1e-5
            if q is None:
                assert top[0] == token  # greedy: the drafted token is its own first candidate
            else:
                assert np.allclose(np.exp(logp), q[top], atol=1e-6)


def test_plan_accepts_candidates_without_a_bonus_row():
    """The draft's candidates cover only the drafted positions when the lookahead holds just k tokens."""
    hint = Hint(2, (5, 6), np.array([[5, 7], [6, 8]]), np.log(np.array([[0.6, 0.4], [0.5, 0.5]])), 1e9, 3)
    plan = plan_branches(hint, [1, 2, 5, 6], 1e-3, 0.0)
    assert {(b.at, b.correction) for b in plan.branches} == {(0, 7), (1, 8)}


def test_a_lookahead_without_its_bonus_guess_outranks_unlikely_branches():
    """When the step verifies the whole lookahead, its guess at the bonus position is not drafted yet; the
    lookahead is still where the step most likely lands (all k accepted), so the worker extends it before
    drafting branches (a score of 0 there made the worker draft branches through the pass and left the next
    step waiting for its draft)."""
    logp = np.log(np.array([[0.6, 0.4], [0.5, 0.5]]))
    with_alpha = Hint(2, (5, 6), np.array([[5, 7], [6, 8]]), logp, 1e9, 3, alpha=0.9)
    plan = plan_branches(with_alpha, [1, 2, 5, 6], 1e-3, 0.0)
    assert plan.lookahead_score == pytest.approx(0.9 ** 3)
    assert all(b.score < plan.lookahead_score for b in plan.branches)
    guessed = plan_branches(with_alpha, [1, 2, 5, 6, 3], 1e-3, 0.0)  # the guess is drafted, its candidates not sent
    assert guessed.lookahead_score == pytest.approx(0.9 ** 3)
    early_exit = Hint(2, (5, 6), np.array([[5, 7], [6, 8], [9, 4]]), np.log(np.array([[0.6, 0.4], [0.5, 0.5],
                                                                                          [0.7, 0.3]])), 1e9, 3)
    plan = plan_branches(early_exit, [1, 2, 5, 6], 1e-3, 0.0)
    assert plan.lookahead_score == pytest.approx(0.6 * 0.5)  # at most: the chance that both pass
    assert {(b.at, b.correction) for b in plan.branches} == {(0, 7), (1, 8), (2, 9), (2, 4)}


def test_stats_add_up_hinted_steps():
    rec = StatsRecorder(prompt_tokens=3, pipeline="branches")

    def step(n_drafted, n_accepted, branch, hint):
        return Step([1] * (n_accepted + 1), n_drafted, n_accepted, "torch:cpu", 0.0, 0.1, None, branch, None, hint)

    rec.add(step(4, 1, "hit", HintOutcome("draft", 1, 9, True, "ready", 3, 2)), 2)
    rec.add(step(4, 2, "miss", HintOutcome("draft", 2, 8, True, "queued", 3, 1)), 3)
    rec.add(step(4, 0, "miss", HintOutcome("draft", 0, 7, False, "none", None)), 1)
    rec.add(step(4, 4, None, HintOutcome("draft", None, 6, False, "none", 2, 2)), 5)
    rec.add(step(4, 4, None, None), 5)
    s = rec.snapshot(1.0)
    assert (s.hinted_steps, s.hinted_rejections, s.hinted_covered) == (4, 3, 2)
    assert s.branch_coverage == pytest.approx(2 / 3)
    assert s.branch_hit_rate == pytest.approx(1 / 3)
    assert (s.branches_planned, s.branches_ready, s.branch_plans_late) == (8, 5, 1)
    assert s.branches_ready_share == pytest.approx(5 / 8)
    assert s.branch_states == {"ready": 1, "queued": 1, "none": 1} and s.branch_source == "draft"
    d = s.to_dict()
    assert d["branch_coverage"] == pytest.approx(2 / 3) and d["branches_ready_share"] == pytest.approx(5 / 8)
    empty = StatsRecorder(prompt_tokens=3).snapshot(1.0)
    assert empty.branch_coverage is None and empty.branches_ready_share is None


def test_draft_candidates_land_branch_hits_with_a_draft_close_to_the_target(target_model, tokenizer, expected):
    """A draft that is the target with a noisy LM head: its second choices often are the target's first. With a
    verify pass long enough to draft branches in (20 ms, as a large target's), the steps that leave the
    lookahead land on prepared branches."""
    import copy
    import time

    near = copy.deepcopy(target_model)
    torch.manual_seed(5)
    with torch.no_grad():
        near.lm_head.weight.add_(torch.randn_like(near.lm_head.weight) * 0.1)
    slow = target_model.model.layers[0].register_forward_pre_hook(lambda *_: time.sleep(0.02))
    try:
        engine = Engine(target_model, tokenizer, ModelDrafter(TorchCausalLM(near)))
        engine.eos_ids = frozenset()
        cfg = GenerationConfig(max_new_tokens=40, num_draft_tokens=3, adaptive_k=False, pipeline="branches",
                               branch_width=3, branch_source="draft")
        hits = tried = covered = rejections = planned = ready = 0
        for prompt in PROMPTS * 2:  # two rounds: a timing-based share over ~60 steps, not ~30
            result = engine.generate(prompt, cfg)
            assert result.token_ids == expected[prompt]
            s = result.stats
            hits, tried = hits + s.branch_hits, tried + s.branch_hits + s.branch_misses
            covered, rejections = covered + s.hinted_covered, rejections + s.hinted_rejections
            planned, ready = planned + s.branches_planned, ready + s.branches_ready
    finally:
        slow.remove()
    assert rejections > 0 and covered / rejections > 0.7, (covered, rejections)
    assert tried > 0 and hits / tried > 0.5, (hits, tried)
    assert planned > 0 and ready / planned > 0.5, (ready, planned)


def test_draft_candidates_are_ranked_with_the_acceptance_rate():
    """A draft is sure of its own tokens: with alpha given, the step reaches position i with alpha^i, is
    rejected there with 1 - alpha, and the alternatives share that by their draft probabilities."""
    logp = np.log(np.array([[0.98, 0.015, 0.005], [0.9, 0.1, 1e-9]]))
    hint = Hint(2, (5, 6), np.array([[5, 7, 9], [6, 8, 4]]), logp, 1e9, 3, alpha=0.8)
    plan = plan_branches(hint, [1, 2, 5, 6], 1e-3, 0.0)
    scores = {(b.at, b.correction): b.score for b in plan.branches}
    assert scores[(0, 7)] == pytest.approx(0.2 * 0.75) and scores[(0, 9)] == pytest.approx(0.2 * 0.25)
    assert scores[(1, 8)] == pytest.approx(0.8 * 0.2, rel=1e-6) and (1, 4) not in scores  # below MIN_BRANCH_SCORE
    assert [b.score for b in plan.branches] == sorted(scores.values(), reverse=True)
