from mirrorsd import GenerationConfig
from mirrorsd.runtime.decode.policy.schedule import DraftLengthSchedule


def test_adaptive_k_grows_on_full_acceptance_and_shrinks_otherwise():
    s = DraftLengthSchedule(GenerationConfig(num_draft_tokens=4, max_draft_tokens=9))
    assert s.update(4, 4) == 6
    assert s.update(6, 6) == 8
    assert s.update(8, 8) == 9  # capped
    assert s.update(9, 2) == 8
    for _ in range(20):
        s.update(s.k, 0)
    assert s.k == 1  # never below one
    assert s.update(0, 0) == 1  # an empty draft (no n-gram match) says nothing about acceptance


def test_fixed_k_when_adaptive_is_off():
    s = DraftLengthSchedule(GenerationConfig(num_draft_tokens=5, adaptive_k=False))
    assert [s.update(5, n) for n in (5, 0, 3)] == [5, 5, 5]


# -- the cost model and the cost-aware schedule ----------------------------------------------------

from mirrorsd.runtime.decode.policy.schedule import CostAwareSchedule, make_schedule  # noqa: E402


def feed(schedule, alpha_steps, draft_per_token, verify_a, verify_b=0.0, steps=40):
    """Drive a schedule with synthetic steps: `alpha_steps` yields n_accepted for a draft of k."""
    for _ in range(steps):
        k = schedule.k
        n = alpha_steps(k)
        schedule.observe(k, k * draft_per_token, verify_a + verify_b * k)
        schedule.update(k, n)
    return schedule.k


def test_cost_aware_k_follows_draft_cost_and_acceptance():
    cfg = GenerationConfig(num_draft_tokens=4, max_draft_tokens=16)
    step = iter(range(10**6))
    mostly = lambda k: k if next(step) % 3 else k // 2  # noqa: E731 - about one rejection per 12 tokens
    high = feed(CostAwareSchedule(cfg), mostly, 0.001, 0.1)  # cheap draft, high acceptance: long drafts
    slow = feed(CostAwareSchedule(cfg), mostly, 0.1, 0.1)  # a draft as slow as the target: K stays minimal
    low = feed(CostAwareSchedule(cfg), lambda k: 0, 0.001, 0.1)  # nothing accepted: short drafts
    assert high >= 8 and slow == 1 and low == 1
    # a verify pass that grows with k (a CPU target) caps K
    capped = feed(CostAwareSchedule(cfg), mostly, 0.001, 0.1, verify_b=0.02)
    assert capped < high


def test_overlap_grows_k_until_drafting_fills_the_verify_pass():
    """All accepted, c = 0.2: sequentially every extra token still pays (K = 16); overlapped, drafting
    is free up to one verify pass (K c = 1, K = 5) and beyond that it delays the next step."""
    cfg = GenerationConfig(num_draft_tokens=2, max_draft_tokens=16)
    assert feed(CostAwareSchedule(cfg), lambda k: k, 0.02, 0.1) == 16
    assert feed(CostAwareSchedule(cfg, overlapped=True), lambda k: k, 0.02, 0.1) == 5


def test_overlapped_steps_after_a_miss_wait_for_a_short_draft():
    """A draft token costing a third of a verify pass, about one rejection per 12 tokens: overlapped, a step
    after a miss verifies fewer tokens than K (the target idles for them); sequentially, and in the
    deterministic schedule, every step waits for K."""
    cfg = GenerationConfig(num_draft_tokens=4, max_draft_tokens=16)
    step = iter(range(10**6))
    mostly = lambda k: k if next(step) % 3 else k // 2  # noqa: E731
    overlapped = CostAwareSchedule(cfg, overlapped=True)
    feed(overlapped, mostly, 0.03, 0.1)
    assert 1 <= overlapped.fresh_k < overlapped.k
    sequential = CostAwareSchedule(cfg)
    feed(sequential, mostly, 0.03, 0.1)
    assert sequential.fresh_k == sequential.k
    fixed = DraftLengthSchedule(cfg)
    fixed.update(4, 1)
    assert fixed.fresh_k == fixed.k == 3


def test_before_costs_are_measured_a_step_after_a_miss_waits_for_one_token_overlapped():
    """The request's first measured step may follow a miss (the draft guessed the target's first token wrong
    while the target prefilled): overlapped, it verifies the worker's first token instead of idling for K."""
    cfg = GenerationConfig(num_draft_tokens=8, max_draft_tokens=16)
    overlapped, sequential = CostAwareSchedule(cfg, overlapped=True), CostAwareSchedule(cfg)
    assert (overlapped.k, overlapped.fresh_k) == (8, 1)
    assert (sequential.k, sequential.fresh_k) == (8, 8)
    overlapped.update(0, 0)  # the first step (prefill alone) is not measured: costs still unknown
    assert (overlapped.k, overlapped.fresh_k) == (8, 1)


def test_seeded_sampling_with_a_model_and_fixed_k_use_the_deterministic_schedule():
    assert isinstance(make_schedule(GenerationConfig()), CostAwareSchedule)
    assert isinstance(make_schedule(GenerationConfig(temperature=0.7, seed=3)), DraftLengthSchedule)
    assert isinstance(make_schedule(GenerationConfig(temperature=0.7, seed=3), model_drafts=False), CostAwareSchedule)
    assert isinstance(make_schedule(GenerationConfig(adaptive_k=False)), DraftLengthSchedule)


def test_the_cost_model_says_when_no_k_pays():
    """A model-free draft (c ~ 0) on a target whose pass grows 0.8 plain steps per drafted token (llama.cpp
    on a CPU): rarely accepted, no K beats a plain step; mostly accepted, some K does. Unknown costs: no view."""
    cfg = GenerationConfig(num_draft_tokens=1, max_draft_tokens=8)
    assert CostAwareSchedule(cfg).pays() is None
    rare, often = CostAwareSchedule(cfg), CostAwareSchedule(cfg)
    for k in (0, 1, 2, 1, 0, 3, 1, 2):  # plain steps too, so the verify line has a slope
        rare.observe(k, k * 1e-5, 0.04 + 0.032 * k)
        rare.update(k, 0)
        often.observe(k, k * 1e-5, 0.04 + 0.032 * k)
        often.update(k, k)
    assert rare.pays() is False and often.pays() is True
