"""Model-free drafts verified only as far as their match class pays (runtime/decode/policy/match_classes.py)."""

from mirrorsd.config import GenerationConfig
from mirrorsd.contracts import Draft
from mirrorsd.runtime.decode.policy import match_classes
from mirrorsd.runtime.decode.policy.match_classes import MatchClasses
from mirrorsd.runtime.decode.policy.step_policy import StepPolicy
from mirrorsd.runtime.decode.policy.speedup import expected_tokens_per_step

STEEP = (1.0, 1.5, 1.7, 1.85, 2.2, 2.35, 2.5, 2.75, 3.0)  # smollm2-135m's exact llama.cpp curve, roughly
cost = STEEP


def ngram(n_tokens: int, match: int) -> Draft:
    return Draft(list(range(10, 10 + n_tokens)), None, "ngram", match=match)


def test_a_class_that_is_always_rejected_stops_being_verified():
    classes = MatchClasses()
    verified = 0
    for _ in range(50):
        proposed = ngram(4, match=1)
        draft = classes.fit(proposed, cost)
        verified += bool(draft.tokens)
        classes.learn(proposed, len(draft.tokens), 0, [99])  # rejected, and not the target's own next token
    assert verified <= 3  # a couple of rejections are enough at this cost curve
    assert classes.acceptance[("ngram", 1)].alpha < 0.05


def test_a_skipped_class_learns_from_the_targets_own_tokens_and_comes_back():
    """An unverified draft's first token is checked against the token the plain step committed: the class keeps
    being measured, and is verified again once it would pay."""
    classes = MatchClasses()
    for _ in range(10):
        proposed = ngram(4, match=1)
        classes.learn(proposed, len(classes.fit(proposed, cost).tokens), 0, [99])
    assert classes.fit(ngram(4, match=1), cost).tokens == []
    for _ in range(10):  # the workload changes: the target now writes what the drafts guess
        proposed = ngram(4, match=1)
        draft = classes.fit(proposed, cost)
        classes.learn(proposed, len(draft.tokens), len(draft.tokens), proposed.tokens[: len(draft.tokens) + 1])
    assert len(classes.fit(ngram(4, match=1), cost).tokens) >= 2


def test_a_class_that_is_accepted_is_verified_to_the_length_that_pays_most():
    classes = MatchClasses()
    for _ in range(30):
        proposed = ngram(8, match=4)
        draft = classes.fit(proposed, cost)
        classes.learn(proposed, len(draft.tokens), len(draft.tokens), draft.tokens + [0])  # every token accepted
    alpha = classes.acceptance[("ngram", 4)].alpha
    best = max(range(9), key=lambda k: expected_tokens_per_step(alpha, k) / cost[k])
    assert alpha > 0.9 and len(classes.fit(ngram(8, match=4), cost).tokens) == best >= 6


def test_classes_are_kept_apart_by_source_and_match_length():
    classes = MatchClasses()
    for _ in range(5):
        proposed = ngram(4, match=1)
        classes.learn(proposed, len(classes.fit(proposed, cost).tokens), 0, [99])
    assert classes.fit(ngram(4, match=1), cost).tokens == []
    assert classes.fit(ngram(4, match=3), cost).tokens  # a longer match starts afresh
    assert classes.fit(Draft([1, 2, 3], None, "retrieval", match=1), cost).tokens


def test_the_policy_leaves_model_drafts_and_seeded_sampling_with_a_model_alone():
    model_draft = Draft([1, 2, 3, 4], None, "torch:cpu")  # match 0: a model's draft, K is the schedule's
    policy = StepPolicy(GenerationConfig(), curve=STEEP)
    assert policy.fit(model_draft) is model_draft
    seeded = StepPolicy(GenerationConfig(temperature=0.8, seed=1), curve=STEEP)  # a draft model's request
    for _ in range(10):
        draft = seeded.fit(ngram(4, match=1))
        assert draft.tokens == [10, 11, 12, 13]  # timing must not steer a seeded run's drafts
        seeded.learn(4, 0, [99], 0.0, 0.01, 0.01, measured=True)


def test_a_seeded_request_with_a_model_free_drafter_is_cut_like_any_other():
    """One-hot drafts spend a seed's random stream as plain steps do (verify.py): their length may follow timing."""
    seeded = StepPolicy(GenerationConfig(temperature=0.8, seed=1), curve=STEEP, model_drafts=False)
    assert not seeded.timing_free and seeded.gate.enabled
    lengths = []
    for _ in range(10):
        draft = seeded.fit(ngram(4, match=1))
        lengths.append(len(draft.tokens))
        seeded.learn(len(draft.tokens), 0, [99], 0.0, 0.01, 0.01, measured=True)
    assert lengths[-1] < 4, lengths  # never accepted: cut


def test_the_policy_learns_into_the_verifiers_classes_across_requests():
    class Target:  # only its identity matters here
        pass

    lm = Target()
    assert match_classes.shared(lm) is match_classes.shared(lm)
    for _ in range(2):  # two requests on one target
        policy = StepPolicy(GenerationConfig(), curve=STEEP, matches=match_classes.shared(lm))
        for _ in range(3):
            draft = policy.fit(ngram(4, match=1))
            policy.learn(len(draft.tokens), 0, [99], 0.0, 0.01, 0.01, measured=True)
    assert match_classes.shared(lm).acceptance[("ngram", 1)].alpha < 0.3
    assert match_classes.shared(Target()).acceptance == {}  # another target starts afresh
