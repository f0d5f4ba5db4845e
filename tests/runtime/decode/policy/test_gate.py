"""The speculation gate on synthetic step timings."""

import pytest

from mirrorsd.runtime.decode.policy.gate import SpeculationGate


def run_steps(gate, n, drafted_rate, plain_rate):
    """Feed n steps; return how many of them drafted."""
    drafted = 0
    for _ in range(n):
        if gate.should_draft():
            drafted += 1
            gate.record(True, 1, 1 / drafted_rate)
        else:
            gate.record(False, 1, 1 / plain_rate)
    return drafted


def test_drafting_that_pays_is_never_paused():
    gate = SpeculationGate(probe_steps=1)
    gate.record(False, 1, 0.05)  # a plain step: 20 tok/s
    assert run_steps(gate, 100, drafted_rate=50, plain_rate=20) == 100


def test_drafting_that_costs_is_paused_and_probed_with_growing_backoff():
    gate = SpeculationGate(min_backoff=4, max_backoff=16, probe_steps=1)
    gate.record(False, 1, 0.05)  # plain: 20 tok/s
    drafted = run_steps(gate, 200, drafted_rate=10, plain_rate=20)
    assert 3 <= drafted <= 20  # a few probes, not every step
    assert gate.backoff == 16


def test_drafting_resumes_when_it_pays_again():
    gate = SpeculationGate(min_backoff=4, max_backoff=16, probe_steps=1)
    gate.record(False, 1, 0.05)
    run_steps(gate, 50, drafted_rate=10, plain_rate=20)
    assert run_steps(gate, 100, drafted_rate=60, plain_rate=20) >= 80
    assert gate.backoff == 4


def test_disabled_gate_always_drafts():
    gate = SpeculationGate(enabled=False)
    gate.record(False, 1, 0.01)
    assert run_steps(gate, 30, drafted_rate=1, plain_rate=100) == 30


def test_a_drafter_that_always_proposes_still_gets_a_plain_step_to_compare_with():
    gate = SpeculationGate(min_backoff=4, max_backoff=16, measure_plain_after=3, probe_steps=1)
    assert run_steps(gate, 4, drafted_rate=10, plain_rate=20) == 3  # three drafted, then one plain
    assert gate.plain_rate == 20
    assert run_steps(gate, 100, drafted_rate=10, plain_rate=20) <= 10  # now it pauses


def test_one_unlucky_step_does_not_pause_drafting_and_probes_span_several_steps():
    """Rates are ratios of averaged tokens and seconds: a step that commits 1 token after a long draft
    pulls the average down a little, not to its own rate."""
    gate = SpeculationGate(min_backoff=4, probe_steps=3)
    gate.record(False, 1, 0.4)  # plain: 2.5 tok/s
    for _ in range(5):
        gate.record(True, 12, 2.0)  # 6 tok/s
    gate.record(True, 1, 2.0)  # one unlucky step: 0.5 tok/s
    assert gate.should_draft() and gate.paused_for == 0
    for _ in range(10):  # drafting stops paying
        gate.record(True, 2, 2.0)
    assert gate.paused_for == 4
    assert [gate.should_draft() for _ in range(4)] == [False, False, False, True]  # then a probe begins
    gate.record(True, 1, 2.0)  # a probe's unlucky first step is judged with the next two
    assert gate.should_draft()
    gate.record(True, 14, 2.0)
    gate.record(True, 14, 2.0)
    assert gate.paused_for == 0 and gate.backoff == 4 and gate.drafted_rate == pytest.approx(29 / 6)


def test_a_pause_from_the_cost_model_is_probed_like_a_measured_loss_and_ignored_during_a_probe():
    gate = SpeculationGate(min_backoff=4, probe_steps=2)
    assert gate.should_draft()
    gate.pause()
    assert [gate.should_draft() for _ in range(4)] == [False, False, False, True]  # then a probe
    gate.pause()  # the probe's own measured rates decide, not the model
    assert gate.should_draft()
    disabled = SpeculationGate(enabled=False)
    disabled.pause()
    assert disabled.should_draft()  # seeded sampling: the gate never switches


def test_steps_whose_drafts_were_cut_to_nothing_count_as_drafting_for_the_gate():
    """A model-free draft that its match class cuts to no tokens still cost its lookup: when such steps run
    slower than plain ones, the policy's gate stops asking for drafts (no lookup at all)."""
    from mirrorsd.config import GenerationConfig
    from mirrorsd.contracts import Draft
    from mirrorsd.runtime.decode.policy.step_policy import StepPolicy

    policy = StepPolicy(GenerationConfig(), curve=(1.0, 1.5, 1.7, 1.85, 2.2))
    asked = 0
    for _ in range(60):
        if policy.draft_length(4) == 0:  # a plain step: 10 ms
            policy.learn(0, 0, [99], 0.0, 0.010, 0.010, measured=True)
            continue
        asked += 1
        draft = policy.fit(Draft([1, 2, 3, 4], None, "ngram", match=1))
        # drafting took 1 ms; the first token is never the target's, so the class soon verifies nothing
        policy.learn(len(draft.tokens), 0, [99], 0.001, 0.010 * (1 + 0.5 * bool(draft.tokens)), 0.011, measured=True)
    assert policy.gate.drafted_rate < policy.gate.plain_rate
    assert asked <= 20  # paused with growing backoff, probed now and then
