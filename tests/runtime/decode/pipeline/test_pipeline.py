"""The two-queue pipeline: same output as target-only decoding in every mode, with every drafter; faults,
hangs and cancellation leave no thread behind; seeded sampling reproduces the inline loop exactly."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from mirrorsd import Engine, FinishEvent, GenerationConfig
from mirrorsd.contracts import ExitRequest
from mirrorsd.errors import ConfigError
from mirrorsd.runtime.decode.policy.schedule import DraftLengthSchedule
from mirrorsd.runtime.drafters import ChainDrafter, NGramDrafter, RetrievalDrafter, ModelDrafter
from mirrorsd.runtime.backends.torch_lm import TorchCausalLM
from drafters_for_tests import FailingDrafter, RandomTokenDrafter
from helpers import PROMPTS, decode_steps, hf_greedy

MODES = ["off", "overlap", "branches"]


def draft_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "mirrorsd-draft"]


def wait_for_no_draft_threads(timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while draft_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not draft_threads(), "a draft worker thread outlived its request"


@pytest.fixture(scope="module")
def expected(target_model, tokenizer):
    return {p: hf_greedy(target_model, tokenizer, p, 40) for p in PROMPTS}


def drafter_for(kind, target_model, other_model, tokenizer, datastore=None):
    return {
        "self": lambda: ModelDrafter(TorchCausalLM(target_model)),
        "other-model": lambda: ModelDrafter(TorchCausalLM(other_model)),
        "random": lambda: RandomTokenDrafter(len(tokenizer)),
        "ngram": lambda: NGramDrafter(max_ngram=3, min_ngram=1),
        "chain": lambda: ChainDrafter(NGramDrafter(), RetrievalDrafter(datastore)),
    }[kind]()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["self", "other-model", "random", "ngram", "chain"])
@pytest.mark.parametrize("adaptive", [True, False])
def test_greedy_equals_target_only_in_every_mode(mode, kind, adaptive, target_model, other_model, tokenizer,
                                                 expected, datastore):
    engine = Engine(target_model, tokenizer, drafter_for(kind, target_model, other_model, tokenizer, datastore))
    engine.eos_ids = frozenset()
    cfg = GenerationConfig(max_new_tokens=40, num_draft_tokens=4, adaptive_k=adaptive, pipeline=mode,
                           early_exit_layer=1)
    for prompt in PROMPTS:
        result = engine.generate(prompt, cfg)
        assert result.token_ids == expected[prompt], (mode, kind, prompt)
        s = result.stats
        assert s.pipeline == mode and s.generated_tokens == 40 and not s.fallbacks
        if kind == "self":
            assert s.acceptance_rate == 1.0
        if kind in ("random", "other-model"):  # rejections: the target and the lookahead rolled back
            assert s.drafted_tokens > 0 and s.accepted_tokens < s.drafted_tokens
        if mode == "branches" and kind in ("random", "other-model"):
            assert s.branch_hits + s.branch_misses > 0  # early-exit hints reached the draft worker
        if mode != "off" and kind in ("self", "other-model"):
            assert 0.0 <= s.draft_hidden_s <= s.draft_time_s
    wait_for_no_draft_threads()


def test_branches_hit_when_the_early_exit_layer_is_the_last(target_model, other_model, tokenizer, expected):
    """With l_e at the last layer the early-exit candidates are the target's own top tokens, so the
    correction after a rejection is almost always a prepared branch."""
    engine = Engine(target_model, tokenizer, ModelDrafter(TorchCausalLM(other_model)))
    engine.eos_ids = frozenset()
    last = engine.target.early_exit.num_layers
    with pytest.raises(ConfigError):
        engine.generate(PROMPTS[0], GenerationConfig(pipeline="branches", early_exit_layer=last,
                                                     branch_source="early_exit"))
    # The hook at layer L-1 of 2 still reads the LM head through the final norm: a strong hint on this model.
    cfg = GenerationConfig(max_new_tokens=40, num_draft_tokens=3, adaptive_k=False, pipeline="branches",
                           early_exit_layer=last - 1, branch_width=4, branch_source="early_exit")
    hits = misses = 0
    for prompt in PROMPTS:
        result = engine.generate(prompt, cfg)
        assert result.token_ids == expected[prompt]
        hits, misses = hits + result.stats.branch_hits, misses + result.stats.branch_misses
    assert hits + misses > 0 and result.stats.branch_hit_rate is not None


def test_early_exit_hook_leaves_logits_bit_identical_and_reads_layer_le(target_model, tokenizer):
    lm = TorchCausalLM(target_model)
    ids = tokenizer(PROMPTS[0])["input_ids"]
    plain = lm.score(ids[:-3], ids[-3:])
    lm.reset()
    seen = []
    hooked = lm.early_exit.score_with_exit(ids[:-3], ids[-3:], ExitRequest(1, 5, lambda i, lp: seen.append((i, lp))))
    assert torch.equal(plain, hooked)
    (top_ids, top_logp), = seen
    top_ids, top_logp = torch.from_numpy(top_ids), torch.from_numpy(top_logp)
    assert top_ids.shape == (4, 5) and top_logp.shape == (4, 5)
    with torch.no_grad():
        hidden = target_model(torch.tensor([ids]), output_hidden_states=True).hidden_states[1][0, -4:]
        ref = torch.log_softmax(target_model.lm_head(target_model.model.norm(hidden)).float(), -1)
    ref_logp, ref_ids = torch.topk(ref, 5, dim=-1)
    assert torch.equal(top_ids, ref_ids) and torch.allclose(top_logp, ref_logp, atol=1e-5)


@pytest.mark.parametrize("mode", ["overlap", "branches"])
def test_seeded_sampling_reproduces_the_sequential_loop_exactly(mode, target_model, other_model, tokenizer):
    """Draft draws are keyed by their context and K does not depend on timing when seeded, so the
    pipeline takes exactly the inline loop's path: same tokens, whatever ran ahead or was discarded."""
    engine = Engine(target_model, tokenizer, ModelDrafter(TorchCausalLM(other_model)))
    engine.eos_ids = frozenset()
    for seed in range(4):
        base = dict(temperature=0.9, max_new_tokens=30, num_draft_tokens=3, seed=seed)
        seq = engine.generate(PROMPTS[1], GenerationConfig(**base, pipeline="off"))
        pipe = engine.generate(PROMPTS[1], GenerationConfig(**base, pipeline=mode, early_exit_layer=1))
        assert pipe.token_ids == seq.token_ids
        assert pipe.stats.drafted_tokens == seq.stats.drafted_tokens > 0


class HangingDrafter(RandomTokenDrafter):
    """Answers twice, then blocks in propose() for `seconds`."""

    name = "hanging"

    def __init__(self, vocab_size: int, seconds: float) -> None:
        super().__init__(vocab_size)
        self.seconds, self.calls = seconds, 0

    def propose(self, committed, max_tokens):
        self.calls += 1
        if self.calls > 2:
            time.sleep(self.seconds)
        return super().propose(committed, max_tokens)


class DyingDrafter(RandomTokenDrafter):
    """Ends its thread: SystemExit from inside the drafter (what a crashing native backend looks like)."""

    name = "dying"

    def propose(self, committed, max_tokens):
        raise SystemExit("draft device lost")


@pytest.mark.parametrize("mode", ["overlap", "off"])
@pytest.mark.parametrize("how", ["raise", "garbage", "too-long", "feedback-raises", "hang", "die"])
def test_faulty_drafter_is_dropped_output_unchanged_no_thread_left(how, mode, target_model, tokenizer, expected):
    if mode == "off" and how in ("hang", "die"):
        pytest.skip("a hang needs the draft worker's timeout; with the pipeline off the drafter is called inline")
    vocab = len(tokenizer)
    drafter = {"hang": lambda: HangingDrafter(vocab, 1.5), "die": lambda: DyingDrafter(vocab)}.get(
        how, lambda: FailingDrafter(vocab, how))()
    engine = Engine(target_model, tokenizer, drafter, helper=NGramDrafter(max_ngram=3, min_ngram=1))
    engine.eos_ids = frozenset()
    cfg = GenerationConfig(max_new_tokens=40, num_draft_tokens=3, pipeline=mode, draft_timeout_s=0.3)
    result = engine.generate(PROMPTS[0], cfg)
    assert result.token_ids == expected[PROMPTS[0]]
    s = result.stats
    assert len(s.fallbacks) == 1 and drafter.name in s.fallbacks[0]
    assert s.drafters.get("ngram", 0) > 0  # the fallback drafter served after the drop
    wait_for_no_draft_threads()
    # The next request starts afresh with the same (now answering) drafter.
    assert engine.generate(PROMPTS[0], cfg).token_ids == expected[PROMPTS[0]]
    wait_for_no_draft_threads()


def test_hung_drafter_is_not_shared_with_the_next_request(target_model, tokenizer, expected):
    """While a hung call from request 1 is still running, request 2 must not call into that drafter."""
    drafter = HangingDrafter(len(tokenizer), 2.0)
    engine = Engine(target_model, tokenizer, drafter)
    engine.eos_ids = frozenset()
    cfg = GenerationConfig(max_new_tokens=20, num_draft_tokens=3, pipeline="overlap", draft_timeout_s=0.2)
    first = engine.generate(PROMPTS[0], cfg)
    second = engine.generate(PROMPTS[0], cfg)
    assert first.token_ids == second.token_ids == expected[PROMPTS[0]][:20]
    assert "earlier request" in second.stats.fallbacks[0]
    wait_for_no_draft_threads()


@pytest.mark.parametrize("mode", MODES)
def test_cancel_mid_stream_stops_the_worker_and_keeps_caches_consistent(mode, target_model, other_model,
                                                                          tokenizer, expected):
    engine = Engine(target_model, tokenizer, ModelDrafter(TorchCausalLM(other_model)))
    engine.eos_ids = frozenset()
    cfg = GenerationConfig(max_new_tokens=40, num_draft_tokens=3, pipeline=mode, early_exit_layer=1)
    stream = engine.stream(PROMPTS[2], cfg)
    got = [next(stream).token_id for _ in range(5)]
    stream.close()
    assert got == expected[PROMPTS[2]][:5]
    wait_for_no_draft_threads(2.0)
    assert engine.generate(PROMPTS[2], cfg).token_ids == expected[PROMPTS[2]]  # engine usable, same output
    with engine:
        pass  # the context manager closes cleanly after a cancelled request
    wait_for_no_draft_threads(2.0)


def test_trace_file_has_both_lanes_and_stats_account_for_overlap(tmp_path, target_model, other_model, tokenizer):
    engine = Engine(target_model, tokenizer, ModelDrafter(TorchCausalLM(other_model)))
    engine.eos_ids = frozenset()
    path = tmp_path / "trace.json"
    result = engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=30, pipeline="branches",
                                                          early_exit_layer=1), trace=str(path))
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    lanes = {e["cat"] for e in spans}
    assert lanes == {"draft", "verify"}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    s = result.stats
    draft_busy = sum(e["dur"] for e in spans if e["cat"] == "draft") / 1e6
    assert s.draft_time_s == pytest.approx(draft_busy, rel=1e-3, abs=1e-4)
    assert 0.0 <= s.hidden_draft_share <= 1.0
    assert s.verify_idle_s >= 0 and s.draft_idle_s >= 0


def test_greedy_through_pipeline_with_eos_and_stop_strings(target_model, other_model, tokenizer):
    """Stops found mid-step end the stream with the same text in every mode."""
    engine = Engine(target_model, tokenizer, ModelDrafter(TorchCausalLM(other_model)))
    texts = set()
    for mode in MODES:
        cfg = GenerationConfig(max_new_tokens=40, pipeline=mode, stop=("e",), early_exit_layer=1)
        results = [e.result for e in engine.stream(PROMPTS[0], cfg) if isinstance(e, FinishEvent)]
        texts.add((results[0].text, results[0].finish_reason))
    assert len(texts) == 1
    wait_for_no_draft_threads()


def test_bad_pipeline_mode_is_a_config_error():
    with pytest.raises(ConfigError, match="pipeline"):
        GenerationConfig(pipeline="parallel")
    with pytest.raises(ConfigError):
        GenerationConfig(draft_timeout_s=0)


def test_cpu_threads_are_split_and_restored(target_model, other_model, tokenizer):
    before = torch.get_num_threads()
    engine = Engine(target_model, tokenizer, ModelDrafter(TorchCausalLM(other_model)))
    engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=10, pipeline="overlap"))
    assert torch.get_num_threads() == before


class SlowRandomDrafter(RandomTokenDrafter):
    """Drafts that never get accepted and cost 20 ms each: speculation cannot pay."""

    name = "slow-random"

    def propose(self, committed, max_tokens):
        time.sleep(0.02)
        return super().propose(committed, max_tokens)


@pytest.mark.parametrize("mode", ["off", "overlap"])
def test_speculation_switches_itself_off_when_it_does_not_pay(mode, target_model, tokenizer, expected):
    engine = Engine(target_model, tokenizer, SlowRandomDrafter(len(tokenizer)))
    engine.eos_ids = frozenset()
    result = engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=40, num_draft_tokens=4, pipeline=mode))
    assert result.token_ids == expected[PROMPTS[0]]
    steps = result.stats.drafters
    assert steps["none"] > 2 * steps.get("slow-random", 0)  # mostly plain steps, with periodic probes
    assert steps.get("slow-random", 0) >= 2  # ... and it did probe again
    wait_for_no_draft_threads()


class SlowDraftModel(ModelDrafter):
    """A draft model on a slow device: 30 ms per drafted token, far slower than a tiny verify pass."""

    def propose_iter(self, committed, max_tokens):
        for pair in super().propose_iter(committed, max_tokens):
            time.sleep(0.03)
            yield pair

    def propose_ranked(self, committed, max_tokens, kappa):  # what the worker calls for "branches"
        for ranked in super().propose_ranked(committed, max_tokens, kappa):
            time.sleep(0.03)
            yield ranked


@pytest.mark.parametrize("mode", ["overlap", "branches"])
def test_per_step_the_pipeline_serves_the_quicker_model_free_draft(mode, target_model, tokenizer, expected):
    """While the slow draft model's lookahead is short, an n-gram draft made at once promises more tokens
    per second: those steps are the n-gram's, the others the model's, and the output is unchanged."""
    drafter = SlowDraftModel(TorchCausalLM(target_model), name="slow-self")
    engine = Engine(target_model, tokenizer, drafter, helper=NGramDrafter(max_ngram=3, min_ngram=1))
    engine.eos_ids = frozenset()
    result = engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=40, num_draft_tokens=4, pipeline=mode))
    assert result.token_ids == expected[PROMPTS[0]]
    s = result.stats
    assert s.drafters.get("ngram", 0) > 0 and s.drafters.get("slow-self", 0) > 0, s.drafters
    assert not s.fallbacks
    seeded = engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=20, num_draft_tokens=4, pipeline=mode,
                                                          temperature=0.8, seed=3))
    assert "ngram" not in seeded.stats.drafters  # a seeded run must not depend on timing: the model serves
    wait_for_no_draft_threads()


def test_auto_picks_the_mode_a_calibration_measured_faster(target_model, other_model, tokenizer):
    """auto: a draft model's mode comes from a calibration on its placement (cached per engine); a model-free
    drafter runs sequentially; an explicit mode is honoured."""
    from mirrorsd.runtime.decode.policy.calibrate import Costs

    cfg = GenerationConfig(pipeline="auto", num_draft_tokens=4)
    engine = Engine(target_model, tokenizer, ModelDrafter(TorchCausalLM(other_model)))
    mode = engine.pipeline_mode(cfg)
    (costs,) = engine.calibrated.costs.values()
    assert mode == costs.mode and costs.k == 4
    assert min(costs.verify_s, costs.draft_token_s, costs.verify_shared_s, costs.draft_token_shared_s) > 0
    assert engine.pipeline_mode(cfg) == mode and len(engine.calibrated.costs) == 1  # measured once
    assert engine.generate(PROMPTS[0], cfg).stats.pipeline == mode
    assert engine.pipeline_mode(GenerationConfig(pipeline="overlap")) == "overlap"  # asked for: honoured
    assert Engine(target_model, tokenizer, NGramDrafter()).pipeline_mode(cfg) == "off"
    # The rule itself: overlap where side by side beats one after the other by the margin.
    assert Costs(4, verify_s=0.10, draft_token_s=0.02, verify_shared_s=0.11, draft_token_shared_s=0.025).mode == \
        "overlap"  # 0.11 against 0.18
    assert Costs(4, verify_s=0.10, draft_token_s=0.02, verify_shared_s=0.19, draft_token_shared_s=0.04).mode == \
        "off"  # two workers splitting one CPU: 0.19 against 0.18


def test_core_sharing_gives_the_verifier_the_draft_threads_while_the_worker_is_idle(tokenizer):
    """CoreSharing: between decoder layers, the verify pass runs on its own threads while the draft worker
    drafts and on the draft's threads too while it is idle; other threads' passes (a self-draft on the
    same model) are left alone, and closing removes the hooks."""
    from types import SimpleNamespace

    from conftest import make_model
    from mirrorsd.runtime.decode.pipeline.threads import CoreSharing

    model = make_model(tokenizer, seed=0)
    seen: list[int] = []
    probe = model.model.layers[-1].register_forward_hook(lambda *_: seen.append(torch.get_num_threads()))
    worker = SimpleNamespace(drafting=True)
    before = torch.get_num_threads()
    sharing = CoreSharing(TorchCausalLM(model).threads, lambda: worker.drafting, (1, 2))
    ids = torch.tensor([[3, 4, 5]])
    try:
        with torch.inference_mode():
            model(ids)
            worker.drafting = False
            model(ids)
            own: list[int] = []

            def other_pass():
                torch.set_num_threads(1)
                own.append(torch.get_num_threads())
                with torch.inference_mode():
                    model(ids)

            other = threading.Thread(target=other_pass)
            other.start()
            other.join()
        assert seen == [1, 3, own[0]]  # drafting: own threads; idle: both; another thread: untouched
    finally:
        sharing.close()
        probe.remove()
        torch.set_num_threads(before)
    assert sharing._remove is None and not model.model.layers[0]._forward_pre_hooks


class SlowPastTheFirstFreshToken(ModelDrafter):
    """Its first token past the committed history comes at once, every later one after 60 ms: a step that
    waited for more than one fresh token would show it."""

    def start(self, config):
        super().start(config)
        self.base = None

    def accepted(self, committed, n_accepted):
        super().accepted(committed, n_accepted)
        self.base = len(committed)

    def propose_iter(self, committed, max_tokens):
        slow = self.base is not None and len(committed) > self.base
        for pair in super().propose_iter(committed, max_tokens):
            if slow:
                time.sleep(0.06)
            yield pair


class FreshK(DraftLengthSchedule):
    """K fixed at 4 and fresh_k as given (what CostAwareSchedule picks from measured costs)."""

    def __init__(self, config, fresh_k):
        super().__init__(config)
        self._fresh_k = fresh_k

    @property
    def fresh_k(self):
        return self._fresh_k


@pytest.mark.parametrize("fresh_k", [1, 4])
def test_a_step_after_a_miss_verifies_the_first_fresh_tokens_without_waiting_for_k(
        fresh_k, monkeypatch, target_model, other_model, tokenizer, expected):
    """After a rejection the lookahead restarts from the committed history; with fresh_k = 1 the target
    takes what the worker has once the first token is there (the next ones come 60 ms apart), with
    fresh_k = K it waits for all four. Every other step carries K. Output unchanged either way."""
    from mirrorsd.runtime.decode.policy import step_policy
    from mirrorsd.runtime.decode.policy.gate import SpeculationGate

    monkeypatch.setattr(step_policy, "make_schedule", lambda config, *_: FreshK(config, fresh_k))
    monkeypatch.setattr(step_policy, "SpeculationGate", lambda **kw: SpeculationGate(enabled=False))  # every step drafts
    cfg = GenerationConfig(max_new_tokens=40, num_draft_tokens=4, adaptive_k=False)
    drafter = SlowPastTheFirstFreshToken(TorchCausalLM(other_model))
    prompt = tokenizer(PROMPTS[0])["input_ids"]
    steps = list(decode_steps(TorchCausalLM(target_model), drafter, prompt, cfg, 40))
    assert [t for s in steps for t in s.tokens] == expected[PROMPTS[0]]
    done = [sum(len(s.tokens) for s in steps[:i]) for i in range(len(steps))]
    # steps after a rejection, where the request's budget still allowed K = 4
    after_miss = [b.drafted_tokens for i, (a, b) in enumerate(zip(steps, steps[1:]))
                  if a.accepted_tokens < a.drafted_tokens and done[i + 1] + 4 < 40]
    assert len(after_miss) >= 3, [(s.drafted_tokens, s.accepted_tokens) for s in steps]  # the draft is not the target
    assert max(after_miss) < 4 if fresh_k == 1 else set(after_miss) == {4}, after_miss
    wait_for_no_draft_threads()


def test_the_first_step_prefills_the_target_while_the_worker_drafts(target_model, other_model, tokenizer, expected):
    """Overlapped with the cost-aware schedule, the request's first step verifies no draft (the prompt prefill
    runs beside the draft's); the inline loop and seeded sampling draft at once, as before."""

    prompt = tokenizer(PROMPTS[0])["input_ids"]
    cfg = GenerationConfig(max_new_tokens=40, num_draft_tokens=4)
    draft = lambda: ModelDrafter(TorchCausalLM(other_model))  # noqa: E731
    steps = list(decode_steps(TorchCausalLM(target_model), draft(), prompt, cfg, 40))
    assert [t for s in steps for t in s.tokens] == expected[PROMPTS[0]]
    assert steps[0].drafted_tokens == 0 and len(steps[0].tokens) == 1 and steps[0].source == "none"
    assert any(s.drafted_tokens > 0 for s in steps[1:])
    sequential = list(decode_steps(TorchCausalLM(target_model), draft(), prompt, cfg, 40, mode="off"))
    assert sequential[0].drafted_tokens == 4
    seeded = GenerationConfig(max_new_tokens=10, num_draft_tokens=4, temperature=0.8, seed=1)
    run = decode_steps(TorchCausalLM(target_model), draft(), prompt, seeded, 10)
    first = next(run)
    run.close()  # stops the draft worker
    assert first.drafted_tokens == 4
    wait_for_no_draft_threads()


class GrowingK(DraftLengthSchedule):
    """K 2, 4, 6, 8: two more after every step, whatever its outcome."""

    def update(self, n_drafted, n_accepted):
        self.k = min(self.k + 2, 8)
        return self.k


def test_the_worker_drafts_ahead_for_the_k_the_schedule_picks_after_the_step(
        monkeypatch, target_model, other_model, tokenizer, expected):
    """The K schedule learns from a step before the worker hears where the step landed, so the worker's limit
    (2K + 1 tokens past the committed history: the next step's K, its bonus token and the K after it) follows
    a growing K at once; told first, the worker stopped at the old K's limit and idled through the pass."""
    from mirrorsd.runtime.decode.pipeline import provider as pipeline
    from mirrorsd.runtime.decode.policy import step_policy
    from mirrorsd.runtime.decode.policy.gate import SpeculationGate

    monkeypatch.setattr(step_policy, "make_schedule", lambda config, *_: GrowingK(config))
    monkeypatch.setattr(step_policy, "SpeculationGate", lambda **kw: SpeculationGate(enabled=False))
    ahead = []  # per message to the worker: its limit past the committed history
    advance, rebase = pipeline.Advance, pipeline.Rebase
    monkeypatch.setattr(pipeline, "Advance", lambda n, limit, *a: ahead.append(limit - n) or advance(n, limit, *a))
    monkeypatch.setattr(pipeline, "Rebase", lambda e, committed, tokens, limit, *a:
                        ahead.append(limit - len(committed)) or rebase(e, committed, tokens, limit, *a))
    cfg = GenerationConfig(max_new_tokens=40, num_draft_tokens=2)
    prompt = tokenizer(PROMPTS[0])["input_ids"]
    steps = list(decode_steps(TorchCausalLM(target_model), ModelDrafter(TorchCausalLM(other_model)),
                                           prompt, cfg, 40))
    assert [t for s in steps for t in s.tokens] == expected[PROMPTS[0]]
    assert ahead[:5] == [5, 9, 13, 17, 17]  # the request's start (K = 2), then after steps 1-4 (K = 4, 6, 8, 8)
    wait_for_no_draft_threads()


def test_while_the_target_prefills_alone_the_worker_drafts_for_the_largest_k(
        monkeypatch, target_model, other_model, tokenizer, expected):
    """The cost-aware schedule picks K from costs measured after the first step, which prefills the target
    alone: meanwhile the worker's limit is set for max_draft_tokens, not for the starting K."""
    from mirrorsd.runtime.decode.pipeline import provider as pipeline

    ahead = []
    rebase = pipeline.Rebase
    monkeypatch.setattr(pipeline, "Rebase", lambda e, committed, tokens, limit, *a:
                        ahead.append(limit - len(committed)) or rebase(e, committed, tokens, limit, *a))
    cfg = GenerationConfig(max_new_tokens=40, num_draft_tokens=2, max_draft_tokens=6)
    prompt = tokenizer(PROMPTS[0])["input_ids"]
    steps = list(decode_steps(TorchCausalLM(target_model), ModelDrafter(TorchCausalLM(other_model)),
                                           prompt, cfg, 40))
    assert [t for s in steps for t in s.tokens] == expected[PROMPTS[0]]
    assert ahead[0] == 2 * 6 + 1 and steps[0].drafted_tokens == 0
    wait_for_no_draft_threads()
