"""The target's verify-cost curve (runtime/decode/policy/verify_curve.py) as measured while something else loads the
machine: a target whose passes take known times on a clock the test advances, so that the check is exact."""

from types import SimpleNamespace

import pytest

from mirrorsd.runtime.decode.policy import verify_curve

PLAIN, PER_TOKEN = 1.0, 0.25  # a pass over k drafted tokens takes PLAIN + k * PER_TOKEN on a quiet machine
MAX_K = 6
CALLS = 1 + 2 * verify_curve.REPEATS * MAX_K  # a warm-up, then a plain step and a pass over k per pair


class TimedTarget:
    """score() takes its pass's time times the machine's slowdown at that call (`slowdown(call)`, from 1)."""

    def __init__(self, clock: list[float], slowdown) -> None:
        self.clock, self.slowdown, self.calls, self.vocab_size = clock, slowdown, 0, 1000

    def score(self, committed, draft=()):
        self.calls += 1
        self.clock[0] += (PLAIN + PER_TOKEN * len(draft)) * self.slowdown(self.calls)

    def reset(self) -> None:
        pass


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(verify_curve, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    return now


def measure(clock, slowdown) -> tuple[float, ...]:
    target = TimedTarget(clock, slowdown)
    curve = verify_curve.measure(target, MAX_K)
    assert target.calls == CALLS
    return curve


TRUE_CURVE = tuple(round((PLAIN + PER_TOKEN * k) / PLAIN, 3) for k in range(MAX_K + 1))


def test_a_quiet_machine_gives_the_targets_own_curve(clock):
    assert measure(clock, lambda call: 1.0) == TRUE_CURVE


@pytest.mark.parametrize("start", range(2, CALLS + 1))
def test_load_that_starts_at_any_pass_and_stays_changes_nothing(clock, start):
    assert measure(clock, lambda call: 1.0 if call < start else 3.0) == TRUE_CURVE


@pytest.mark.parametrize("paused", range(2, CALLS + 1))
def test_a_pause_on_one_pass_never_makes_a_cost_higher(clock, paused):
    curve = measure(clock, lambda call: 5.0 if call == paused else 1.0)
    assert all(c <= t for c, t in zip(curve, TRUE_CURVE))
    if paused % 2 == 1:  # a pass over k (calls 3, 5, ...): its pair's partner counts, exactly
        assert curve == TRUE_CURVE


@pytest.mark.parametrize("end", range(2, CALLS + 1))
def test_load_that_ends_never_makes_a_cost_higher(clock, end):
    curve = measure(clock, lambda call: 3.0 if call < end else 1.0)
    assert all(c <= t for c, t in zip(curve, TRUE_CURVE))


def test_a_curve_measured_on_a_real_target(target_model):
    from mirrorsd.runtime.backends.torch_lm import TorchCausalLM

    curve = verify_curve.measure(TorchCausalLM(target_model), 4)
    assert len(curve) == 5 and curve[0] == 1.0 and all(0 < c < float("inf") for c in curve)
