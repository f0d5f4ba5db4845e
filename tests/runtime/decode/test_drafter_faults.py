"""Whatever a drafter does -- raise, hang, return garbage ids, a q that is not a distribution, write to the
history it is handed -- it is dropped and the output is the target's: greedy token-equal to target-only
decoding and sampled in the target's distribution, in every decode mode."""

from __future__ import annotations

import numpy as np
import pytest

from drafters_for_tests import FailingDrafter, HistoryCorruptingDrafter
from helpers import PROMPTS, exact_first_two, hf_greedy, pvalue, sample_first_two
from mirrorsd import Draft, Engine, GenerationConfig
from mirrorsd.runtime.decode.drafting import check_draft

pytestmark = pytest.mark.slow  # drafters that hang until their timeout, in every mode

MODES = ("off", "overlap", "branches")


def engine_with(drafter, target_model, tokenizer) -> Engine:
    engine = Engine(target_model, tokenizer, drafter, helper=None)
    engine.eos_ids = frozenset()
    return engine


@pytest.mark.parametrize("how,bounded", [(how, False) for how in FailingDrafter.FAULTS]
                         + [(how, True) for how in FailingDrafter.FAULTS if how != "hang"])
@pytest.mark.parametrize("mode", MODES)
def test_a_faulty_drafter_is_dropped_and_greedy_output_is_unchanged(how, bounded, mode, target_model, tokenizer):
    """On a drafting thread, and on the request's own thread where the drafter declares itself bounded."""
    drafter = FailingDrafter(len(tokenizer), how, hang_s=2.0, bounded=bounded)
    cfg = GenerationConfig(max_new_tokens=20, num_draft_tokens=3, pipeline=mode, draft_timeout_s=0.5,
                           early_exit_layer=1)
    result = engine_with(drafter, target_model, tokenizer).generate(PROMPTS[2], cfg)
    assert result.token_ids == hf_greedy(target_model, tokenizer, PROMPTS[2], 20)
    assert len(result.stats.fallbacks) == 1 and "failing" in result.stats.fallbacks[0], result.stats.fallbacks


@pytest.mark.parametrize("mode", MODES)
def test_a_drafter_cannot_write_to_the_committed_history(mode, target_model, tokenizer):
    drafter = HistoryCorruptingDrafter(len(tokenizer))
    cfg = GenerationConfig(max_new_tokens=20, num_draft_tokens=3, pipeline=mode)
    result = engine_with(drafter, target_model, tokenizer).generate(PROMPTS[0], cfg)
    assert result.token_ids == hf_greedy(target_model, tokenizer, PROMPTS[0], 20)
    assert result.stats.fallbacks and "corrupting" in result.stats.fallbacks[0]


@pytest.mark.parametrize("how", ["nan-q", "negative-q", "unnormalised-q", "zero-q-for-token", "narrow-q"])
@pytest.mark.parametrize("mode", MODES)
def test_a_bad_q_never_changes_the_sampled_distribution(how, mode, target_model, tokenizer):
    """The drafter proposes the tokens it likes best with a broken q from its first step: it is dropped
    before its q reaches the rejection sampler, and the first two tokens follow the target exactly."""
    cfg = GenerationConfig(temperature=0.8, max_new_tokens=2, num_draft_tokens=2, adaptive_k=False, pipeline=mode)
    engine = engine_with(FailingDrafter(len(tokenizer), how, good_steps=0), target_model, tokenizer)
    p1, p2 = exact_first_two(target_model, tokenizer, cfg, PROMPTS[1])
    first, second, _ = sample_first_two(engine, PROMPTS[1], cfg, seeds=600)
    assert pvalue(first, p1) > 1e-3 and pvalue(second, p2) > 1e-3


def test_check_draft_normalises_what_it_accepts_and_names_what_it_refuses():
    ok = check_draft(Draft(np.array([3, 4]), np.full((2, 10), 0.1, dtype=np.float32), "d"), 4, 10)
    assert ok.tokens == [3, 4] and all(type(t) is int for t in ok.tokens) and ok.probs.dtype == np.float64
    for bad, words in [(Draft([True], None, "d"), "integers"), (Draft([1, 2, 3], None, "d"), "more than"),
                       (Draft([1], np.full((1, 10), np.nan), "d"), "not distributions"),
                       (Draft([1], np.full((2, 10), 0.1), "d"), "one row per token"),
                       (Draft([1], np.full((1, 5), 0.2), "d"), "5 wide"),
                       (Draft([1], np.full((1, 20), 0.05), "d"), "20 wide"),
                       ([1, 2], "not a Draft")]:
        with pytest.raises(ValueError, match=words):
            check_draft(bad, 2, 10)
    padded = np.zeros((1, 6464))
    padded[0, 1] = 1.0  # padding to another multiple, with no probability on the padding: accepted
    assert check_draft(Draft([1], padded, "d"), 2, 6400).probs.shape == (1, 6464)
    padded[0, 1], padded[0, 6410] = 0.5, 0.5  # probability on ids the target does not have: refused
    with pytest.raises(ValueError, match="not distributions"):
        check_draft(Draft([1], padded, "d"), 2, 6400)


class GarbageDrafter:
    """Returns random junk of every kind (and now and then a valid draft), seeded."""

    name = "garbage"
    model = None
    learner = None

    def __init__(self, vocab: int, seed: int, bounded: bool = False) -> None:
        self.vocab, self.rng, self.bounded = vocab, np.random.default_rng(seed), bounded

    def start(self, config) -> None:
        pass

    def accepted(self, committed, n_accepted) -> None:
        if self.rng.random() < 0.02:
            raise KeyError("lost track")

    def propose(self, committed, max_tokens):
        r, k = self.rng, int(self.rng.integers(0, max_tokens + 3))
        ids = r.integers(-3, self.vocab + 3, k)
        q = r.random((k, int(r.choice([self.vocab, self.vocab + 4, 3]))))
        choices = [
            lambda: Draft(ids.tolist(), None, self.name),
            lambda: Draft([int(t) % self.vocab for t in ids][:max_tokens], None, self.name),
            lambda: Draft(ids.astype(float).tolist(), None, self.name),
            lambda: Draft([str(t) for t in ids], None, self.name),
            lambda: Draft(ids, q, self.name),
            lambda: Draft([int(t) % self.vocab for t in ids][:max_tokens], q * np.nan, self.name),
            lambda: Draft([int(t) % self.vocab for t in ids][:max_tokens], -q, self.name),
            lambda: Draft([int(t) % self.vocab for t in ids][:max_tokens], q[:, 0], self.name),
            lambda: (ids, q), lambda: None, lambda: "draft", lambda: Draft(None, None, self.name),
            lambda: 1 / 0,
        ]
        return choices[int(r.integers(len(choices)))]()


@pytest.mark.parametrize("bounded", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_random_garbage_from_a_drafter_never_changes_the_output(mode, bounded, target_model, tokenizer):
    expected = hf_greedy(target_model, tokenizer, PROMPTS[0], 16)
    for seed in range(25):
        engine = engine_with(GarbageDrafter(len(tokenizer), seed, bounded), target_model, tokenizer)
        cfg = GenerationConfig(max_new_tokens=16, num_draft_tokens=4, pipeline=mode, draft_timeout_s=2.0)
        assert engine.generate(PROMPTS[0], cfg).token_ids == expected, seed
