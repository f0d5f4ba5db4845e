"""A pinned CoreLayout (runtime/decode/pipeline/threads.py): separate compute simulated on one CPU. The verify side runs on one core
and the draft side on another, one compute thread each, in every pipeline mode; output is unchanged."""

from __future__ import annotations

import os

import pytest
import torch

from helpers import PROMPTS
from mirrorsd import Engine, GenerationConfig
from mirrorsd.errors import ConfigError
from mirrorsd.runtime.backends.torch_lm import TorchCausalLM
from mirrorsd.runtime.decode.pipeline.threads import CoreLayout, CorePins
from mirrorsd.runtime.drafters import ModelDrafter

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                reason="needs per-thread affinity and two cores")


class WhereLM(TorchCausalLM):
    """A model noting on which cores and with how many torch threads each of its passes ran."""

    seen: set

    def score(self, committed, draft=()):
        self.seen.add((frozenset(os.sched_getaffinity(0)), torch.get_num_threads()))
        return super().score(committed, draft)


@pytest.mark.parametrize("mode", ["off", "overlap", "branches"])
def test_each_side_runs_on_its_own_core_and_output_is_unchanged(mode, target_model, tokenizer):
    cores = sorted(os.sched_getaffinity(0))
    pins = CoreLayout(verify_core=cores[0], draft_core=cores[1])
    target, draft_lm = WhereLM(target_model), WhereLM(target_model)
    target.seen, draft_lm.seen = set(), set()
    engine = Engine(target, tokenizer, ModelDrafter(draft_lm), helper=None)
    reference = Engine(target_model, tokenizer, None)
    engine.cores = pins
    cfg = GenerationConfig(max_new_tokens=24, num_draft_tokens=3, pipeline=mode)
    before = (os.sched_getaffinity(0), torch.get_num_threads())
    for prompt in PROMPTS:
        result = engine.generate(prompt, cfg)
        assert result.token_ids == reference.generate(prompt, cfg).token_ids and not result.stats.fallbacks
    assert target.seen == {(frozenset({pins.verify_core}), 1)}
    assert draft_lm.seen == {(frozenset({pins.draft_core}), 1)}
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == before  # the caller's thread is restored
    target.seen.clear()
    engine.cores = CoreLayout()
    engine.generate(PROMPTS[0], cfg)
    # unpinned, no pin leaks: every pass may use every core. (Its thread count is whatever torch gives the
    # thread that runs it: OpenMP keeps the count per thread, and in overlap the pipeline's first step may run
    # the target on another thread than the caller's.)
    assert {cores for cores, _ in target.seen} == {frozenset(before[0])}
    assert all(threads >= before[1] for _, threads in target.seen)


def test_bad_pins_are_config_errors():
    with pytest.raises(ConfigError, match="two different usable cores"):
        CoreLayout(0, 0)
    with pytest.raises(ConfigError, match="usable cores here"):
        CoreLayout(0, 4096)


def test_the_deprecated_core_pins_are_a_pinned_core_layout():
    cores = sorted(os.sched_getaffinity(0))
    with pytest.warns(DeprecationWarning, match="CoreLayout"):
        pins = CorePins(cores[0], cores[1])
    assert pins.layout() == CoreLayout(cores[0], cores[1]) and pins.pinned
