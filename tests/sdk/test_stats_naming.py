"""`stats.drafter` names what served most verify steps ("none" for plain steps, a chain with its members'
shares); `stats.drafters` keeps the per-source step counts and `drafter_shares` their shares."""

from __future__ import annotations

import pytest

from helpers import PROMPTS
from mirrorsd import Engine, GenerationConfig
from mirrorsd.results import GenerationStats
from mirrorsd.runtime.drafters import ChainDrafter, NGramDrafter, RetrievalDrafter


@pytest.mark.parametrize("drafters, chain, name", [
    ({"ngram": 4, "none": 8}, (), "none"),  # plain steps served 8 of 12: not "ngram"
    ({"ngram": 8, "none": 4}, (), "ngram"),
    ({"ngram": 6, "none": 6}, (), "ngram"),  # a tie goes to the drafter
    ({}, (), "none"),
    ({"ngram": 3, "retrieval": 2, "none": 4}, ("ngram", "retrieval"), "chain(ngram 60%, retrieval 40%)"),
    ({"ngram": 1, "none": 4}, ("ngram", "retrieval"), "none"),
    ({"onnx:CPU": 5, "ngram": 2, "none": 1}, (), "onnx:CPU"),  # a model drafter, then its fallback
])
def test_drafter_names_what_served_most_steps(drafters, chain, name):
    stats = GenerationStats(verify_steps=sum(drafters.values()), drafters=drafters, chain=chain)
    assert stats.drafter == name
    assert stats.drafters == drafters  # the per-source record is unchanged


def test_drafter_shares_are_shares_of_verify_steps_largest_first():
    stats = GenerationStats(verify_steps=12, drafters={"ngram": 4, "none": 8})
    assert list(stats.drafter_shares.items()) == [("none", 0.667), ("ngram", 0.333)]
    d = stats.to_dict()
    assert d["drafter"] == "none" and d["drafter_shares"] == {"none": 0.667, "ngram": 0.333}
    assert GenerationStats().drafter_shares == {}


def test_a_chain_reports_itself_with_its_members_shares(target_model, tokenizer, datastore):
    engine = Engine(target_model, tokenizer, ChainDrafter(NGramDrafter(), RetrievalDrafter(datastore)))
    engine.eos_ids = frozenset()
    s = engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=60)).stats
    served = {m: s.drafters.get(m, 0) for m in ("ngram", "retrieval")}
    assert s.chain == ("ngram", "retrieval") and sum(served.values()) > s.drafters.get("none", 0), s.drafters
    total = sum(served.values())
    assert s.drafter == "chain(" + ", ".join(f"{m} {n / total:.0%}" for m, n in served.items()) + ")"
    shares = s.to_dict()["drafter_shares"]
    assert shares == {k: round(v / s.verify_steps, 3) for k, v in sorted(s.drafters.items(), key=lambda kv: -kv[1])}
    assert abs(sum(shares.values()) - 1) < 0.01


def test_a_single_drafter_is_not_named_a_chain(target_model, tokenizer):
    s = Engine(target_model, tokenizer, NGramDrafter()).generate(PROMPTS[0], GenerationConfig(max_new_tokens=30)).stats
    assert s.chain == () and s.drafter in ("ngram", "none")
    assert s.drafter == max(s.drafters, key=lambda k: (s.drafters[k], k != "none"))


def test_acceptance_by_drafter_splits_the_tokens_among_the_sources(target_model, tokenizer, datastore):
    """`drafter_tokens` (source -> drafted, accepted) adds up to the request's totals, and
    `acceptance_by_drafter` is each source's own rate: a draft model's apart from its n-gram helper's."""
    engine = Engine(target_model, tokenizer, ChainDrafter(NGramDrafter(), RetrievalDrafter(datastore)))
    engine.eos_ids = frozenset()
    s = engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=60, num_draft_tokens=4, adaptive_k=False)).stats
    assert s.drafted_tokens > 0 and set(s.drafter_tokens) <= {"ngram", "retrieval"}, s.drafter_tokens
    assert sum(d for d, _ in s.drafter_tokens.values()) == s.drafted_tokens
    assert sum(a for _, a in s.drafter_tokens.values()) == s.accepted_tokens
    assert s.to_dict()["acceptance_by_drafter"] == s.acceptance_by_drafter == {
        source: round(a / d, 3) for source, (d, a) in sorted(s.drafter_tokens.items())}
    assert GenerationStats(drafter_tokens={"onnx:CPU": (20, 19), "ngram": (3, 0)}).acceptance_by_drafter == {
        "ngram": 0.0, "onnx:CPU": 0.95}


def test_time_to_first_token_and_prompt_time_are_measured_once(target_model, tokenizer):
    engine = Engine(target_model, tokenizer, NGramDrafter())
    events = list(engine.stream(PROMPTS[0], GenerationConfig(max_new_tokens=24)))
    firsts = {e.stats.time_to_first_token_s for e in events[:-1]}
    s = events[-1].result.stats
    assert firsts == {s.time_to_first_token_s}  # set by the first token, then kept
    assert 0 < s.prompt_time_s <= s.time_to_first_token_s < s.total_time_s


@pytest.mark.parametrize("drafters, chain, drafted_by, share", [
    ({"ngram": 4, "none": 8}, (), "ngram", 0.333),  # what drafted, though plain steps were the most
    ({}, (), "none", 0.0),
    ({"none": 5}, (), "none", 0.0),
    ({"ngram": 3, "retrieval": 2, "none": 13}, ("ngram", "retrieval"), "chain(ngram 60%, retrieval 40%)", 0.278),
])
def test_drafted_by_names_what_drafted_and_drafting_share_how_often(drafters, chain, drafted_by, share):
    stats = GenerationStats(verify_steps=sum(drafters.values()), drafters=drafters, chain=chain)
    assert (stats.drafted_by, stats.drafting_share) == (drafted_by, share)
    assert stats.to_dict()["drafted_by"] == drafted_by


def test_estimated_speedup_weighs_each_pass_by_the_verify_curve():
    """1 prompt pass + 2 plain steps + 2 passes over 3 drafted tokens (1.5 steps each): 5 decode-step units in
    0.5 s of verify time after the prompt, so a step is 0.1 s; 9 tokens after the first would take plain decoding
    0.9 s against the 0.6 s the reply took."""
    stats = GenerationStats(verify_steps=5, generated_tokens=10, per_position_drafted=(2, 2, 2),
                            verify_curve=(1.0, 1.2, 1.3, 1.5), verify_time_s=0.7, prompt_time_s=0.2,
                            total_time_s=0.8)
    assert stats.estimated_speedup == 1.5
    assert stats.to_dict()["estimated_speedup"] == 1.5
    # a draft longer than the measured curve costs its last slope per token beyond it
    assert GenerationStats(verify_curve=(1.0, 1.2, 1.3, 1.5))._pass_cost(5) == pytest.approx(1.9)


@pytest.mark.parametrize("changes", [dict(verify_curve=()), dict(verify_steps=1), dict(generated_tokens=1)])
def test_no_speedup_estimate_without_a_curve_or_a_decoded_token(changes):
    base = dict(verify_steps=5, generated_tokens=10, per_position_drafted=(2, 2, 2), verify_curve=(1.0, 1.2, 1.3, 1.5),
                verify_time_s=0.7, prompt_time_s=0.2, total_time_s=0.8)
    assert GenerationStats(**{**base, **changes}).estimated_speedup is None


def test_a_prepared_engine_reports_its_speedup_estimate(target_model, tokenizer):
    engine = Engine(target_model, tokenizer, NGramDrafter())
    engine.eos_ids = frozenset()
    engine.prepare(GenerationConfig(max_new_tokens=30))
    stats = engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=30)).stats
    assert len(stats.verify_curve) > 1 and stats.verify_curve[0] == 1.0
    assert stats.estimated_speedup is not None and stats.estimated_speedup > 0


def test_the_step_records_share_the_totals_field_names_and_keep_the_old_ones_deprecated():
    import dataclasses
    import warnings

    from mirrorsd import GenerationStats, Step, StepStats

    totals = {f.name for f in dataclasses.fields(GenerationStats)}
    for record in (Step, StepStats):
        counts_and_times = {f.name for f in dataclasses.fields(record)} & {
            "drafted_tokens", "accepted_tokens", "draft_time_s", "verify_time_s"}
        assert counts_and_times == {"drafted_tokens", "accepted_tokens", "draft_time_s", "verify_time_s"} <= totals
    step = StepStats(3, 2, 3, "ngram", 0.5, 1.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert (step.drafted, step.accepted, step.committed, step.draft_s, step.verify_s) == (3, 2, 3, 0.5, 1.5)
    assert len(caught) == 5 and all(issubclass(w.category, DeprecationWarning) for w in caught)
    with pytest.deprecated_call():
        assert Step([1], 2, 1, "ngram", 0.25, 0.75).n_drafted == 2
