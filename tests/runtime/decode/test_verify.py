"""Tier 1 and 2: verify on degenerate logits, its sampling distribution, and seeded determinism."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from mirrorsd import Draft, SamplingParams, verify
from mirrorsd.runtime.decode.sampling import next_token_scores
from reference import process, verify_reference

GREEDY = SamplingParams()
V = 8


def onehot_logits(ids: list[int], vocab: int = V) -> torch.Tensor:
    """[len(ids), vocab] logits whose argmax in row i is ids[i]."""
    logits = torch.zeros(len(ids), vocab)
    for i, t in enumerate(ids):
        logits[i, t] = 10.0
    return logits


# -- greedy, degenerate logits -----------------------------------------------------------------------

def test_greedy_all_accepted_gets_bonus():
    n, new = verify(Draft([3, 1, 4], None, "t"), onehot_logits([3, 1, 4, 5]), GREEDY, np.random.default_rng(0))
    assert (n, new) == (3, [3, 1, 4, 5])


def test_greedy_first_rejected_gives_correction():
    n, new = verify(Draft([3, 1, 4], None, "t"), onehot_logits([2, 1, 4, 5]), GREEDY, np.random.default_rng(0))
    assert (n, new) == (0, [2])


def test_greedy_middle_rejection_keeps_prefix():
    n, new = verify(Draft([3, 1, 4], None, "t"), onehot_logits([3, 1, 7, 5]), GREEDY, np.random.default_rng(0))
    assert (n, new) == (2, [3, 1, 7])


def test_empty_draft_is_a_plain_decode_step():
    n, new = verify(Draft.empty(), onehot_logits([6]), GREEDY, np.random.default_rng(0))
    assert (n, new) == (0, [6])


def test_greedy_repetition_penalty_changes_the_target_choice():
    logits = torch.tensor([[0.0, 2.0, 1.9, 0, 0, 0, 0, 0]])
    cfg = SamplingParams(repetition_penalty=1.5)
    assert verify(Draft.empty(), logits, cfg, np.random.default_rng(0), history=[1]) == (0, [2])
    assert verify(Draft.empty(), logits, GREEDY, np.random.default_rng(0), history=[1]) == (0, [1])


# -- sampling, degenerate ----------------------------------------------------------------------------

SAMPLE = SamplingParams(temperature=1.0)


def test_sampling_certain_target_accepts_everything():
    logits = onehot_logits([3, 1, 4]) * 100  # p is one-hot at 3, then 1, then bonus 4
    for seed in range(20):
        assert verify(Draft([3, 1], None, "t"), logits, SAMPLE, np.random.default_rng(seed)) == (2, [3, 1, 4])


def test_sampling_token_impossible_for_target_is_always_rejected():
    logits = torch.zeros(2, V)
    logits[0, 5] = float("-inf")  # p(5) = 0
    q = np.full((1, V), 1.0 / V)
    for seed in range(50):
        n, new = verify(Draft([5], q, "t"), logits, SAMPLE, np.random.default_rng(seed))
        assert n == 0 and new[0] != 5


def test_sampling_top_k_removes_tokens_from_p():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, 0, 0, 0, 0]] * 2)
    cfg = SamplingParams(temperature=1.0, top_k=2)
    for seed in range(50):
        n, new = verify(Draft([2], None, "t"), logits, cfg, np.random.default_rng(seed))
        assert n == 0 and new[0] in (0, 1)


# -- processing matches transformers' own logits processors -------------------------------------------

@pytest.mark.parametrize("temperature,top_k,top_p,penalty", [(0.7, 0, 1.0, 1.0), (1.3, 5, 1.0, 1.2),
                                                             (0.9, 0, 0.8, 1.0), (0.5, 20, 0.9, 1.5)])
def test_processing_matches_transformers(temperature, top_k, top_p, penalty):
    from transformers.generation.logits_process import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    torch.manual_seed(0)
    logits = torch.randn(1, 50) * 3
    history = [3, 7, 7, 12]
    procs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(penalty), TemperatureLogitsWarper(temperature)])
    if top_k:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        procs.append(TopPLogitsWarper(top_p))
    expected = torch.softmax(procs(torch.tensor([history]), logits.clone()), dim=-1)
    cfg = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=penalty)
    ours = next_token_scores(logits, cfg, history)
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-5)
    ref = process(logits[0].numpy(), history, temperature, top_k, top_p, penalty)
    np.testing.assert_allclose(ours[0].double().numpy(), ref, atol=1e-6)


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [(0.7, 0, 1.0, 0.05), (1.3, 10, 0.9, 0.2), (1.0, 0, 1.0, 1.0)])
def test_min_p_matches_transformers(temperature, top_k, top_p, min_p):
    from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    torch.manual_seed(2)
    logits = torch.randn(3, 64) * 3
    procs = LogitsProcessorList([TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else [])
                                + ([TopPLogitsWarper(top_p)] if top_p < 1 else []) + [MinPLogitsWarper(min_p)])
    expected = torch.softmax(procs(torch.zeros(3, 1, dtype=torch.long), logits.clone()), dim=-1)
    ours = next_token_scores(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p), [])
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-5)
    assert (ours > 0).sum() < (torch.softmax(logits, -1) > 0).sum()  # it removed tokens: the case is not vacuous


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95, 0.999])
def test_top_p_on_a_large_vocabulary_keeps_what_transformers_keeps(top_p):
    """The partial top-k nucleus (widened when the first 256 tokens hold too little mass) against
    transformers' full sort, on a 151,936-token vocabulary: peaked, middling and flat rows."""
    from transformers.generation.logits_process import TopPLogitsWarper

    from mirrorsd.runtime.decode.sampling import top_p_keep

    torch.manual_seed(1)
    logits = torch.randn(4, 151936) * torch.tensor([[8.0], [3.0], [1.0], [0.1]])
    expected = TopPLogitsWarper(top_p)(torch.zeros(4, 1, dtype=torch.long), logits.clone()) > float("-inf")
    keep = top_p_keep(logits, top_p)
    probs = logits.double().softmax(dim=-1)
    for row in range(4):  # transformers sums 150k float32 terms: only tokens at the boundary may differ
        differ = (keep[row] != expected[row]).nonzero().flatten()
        assert probs[row, differ].sum() < 1e-4, row
        for token in differ:
            above = probs[row][probs[row] > probs[row, token]].sum()
            assert abs(above - top_p) < 1e-4, (row, token, above)
    assert keep[3].sum() > 2048  # the flat row needed the widening


def test_a_rows_nucleus_does_not_depend_on_the_rows_beside_it():
    """A verify pass's row must get the nucleus a plain step's single row gets: a row whose boundary falls among
    tied tokens keeps the same ones beside a flat row that needs the widening (batched, it kept others)."""
    from mirrorsd.runtime.decode.sampling import top_p_keep

    tied = torch.full((4096,), -30.0)
    tied[0], tied[1:400] = 2.0, 0.0
    batch = torch.stack([tied, torch.zeros(4096)])
    together, alone = top_p_keep(batch, 0.6), top_p_keep(tied[None], 0.6)
    assert torch.equal(together[0], alone[0]) and 1 < int(alone[0].sum()) < 400


# -- the statistical test: rejection sampling reproduces p -------------------------------------------

def _random_case(seed: int, vocab: int = 6, k: int = 2):
    r = np.random.default_rng(seed)
    logits = torch.tensor(r.normal(size=(k + 1, vocab)) * 1.5, dtype=torch.float32)
    q = r.dirichlet(np.ones(vocab), size=k)  # [k, V]
    return logits, q


def _chi2_pvalue(samples: list[int], probs: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=len(probs))
    return chisquare(counts, probs / probs.sum() * counts.sum()).pvalue


@pytest.mark.parametrize("one_hot", [False, True], ids=["model-draft", "one-hot-draft"])
def test_rejection_sampling_reproduces_target_distribution(one_hot):
    logits, q = _random_case(seed=3)
    p = torch.softmax(logits, dim=-1).double().numpy()
    rng, draw_rng = np.random.default_rng(123), np.random.default_rng(456)
    first, second_given_accept = [], []
    for _ in range(30000):
        if one_hot:  # a deterministic drafter (n-gram): always the same tokens, q one-hot
            tokens, probs = [1, 4], None
        else:  # a model drafter: tokens drawn from q
            tokens, probs = [int(draw_rng.choice(6, p=q[0])), int(draw_rng.choice(6, p=q[1]))], q
        n, new = verify(Draft(tokens, probs, "t"), logits, SAMPLE, rng)
        first.append(new[0])
        if n >= 1:  # the first token was the draft's; the next committed one must follow p[1]
            second_given_accept.append(new[1])
    assert _chi2_pvalue(first, p[0]) > 1e-3
    assert _chi2_pvalue(second_given_accept, p[1]) > 1e-3


def test_statistical_test_catches_a_verifier_that_skips_the_residual():
    logits, q = _random_case(seed=3)
    p = torch.softmax(logits, dim=-1).double().numpy()
    rng, draw_rng = np.random.default_rng(123), np.random.default_rng(456)
    first = []
    for _ in range(30000):
        tokens = [int(draw_rng.choice(6, p=q[0])), int(draw_rng.choice(6, p=q[1]))]
        _, new = verify_reference(tokens, q, logits.numpy(), [], rng, 1.0, skip_residual=True)
        first.append(new[0])
    assert _chi2_pvalue(first, p[0]) < 1e-6


# -- one-hot drafts spend the random stream as target-only decoding does -------------------------------

@pytest.mark.parametrize("cfg", [SamplingParams(temperature=0.8), SamplingParams(temperature=1.2, top_k=5, top_p=0.9,
                                                                                  repetition_penalty=1.3)],
                         ids=["plain", "all-processors"])
def test_one_hot_drafts_give_target_only_draws_whatever_is_drafted(cfg):
    """A run of plain steps (empty drafts) and runs drafting one-hot tokens of any length, right or wrong, commit
    the same tokens from the same seed: each committed token is one draw from p, as a plain step's is."""
    r = np.random.default_rng(5)
    table = torch.tensor(r.normal(size=(12, 12)) * 2, dtype=torch.float32)  # next-token logits by last token

    def run(draft_for, n: int = 60) -> list[int]:
        rng, out = np.random.default_rng(11), [0]
        while len(out) < n:
            draft = draft_for(out)
            rows = table[[out[-1], *draft]]  # [k+1, V]: row i follows out + draft[:i]
            _, new = verify(Draft(draft, None, "t"), rows, cfg, rng, history=out)
            out += new
        return out[:n]

    plain = run(lambda out: [])
    lucky = run(lambda out: plain[len(out): len(out) + 4])  # the right tokens: all accepted
    guess = np.random.default_rng(7)
    mixed = run(lambda out: plain[len(out): len(out) + int(guess.integers(0, 5))][:2] + [int(guess.integers(0, 12))])
    assert lucky == plain and mixed == plain


# -- seeded determinism against the numpy reference ---------------------------------------------------

@pytest.mark.parametrize("cfg", [SamplingParams(temperature=0.8, seed=7),
                                 SamplingParams(temperature=1.1, top_k=4, top_p=0.9, repetition_penalty=1.3, seed=7),
                                 SamplingParams(seed=7)], ids=["plain", "all-processors", "greedy"])
def test_seeded_verify_matches_numpy_reference_exactly(cfg):
    r = np.random.default_rng(0)
    ours_rng, ref_rng = np.random.default_rng(cfg.seed), np.random.default_rng(cfg.seed)
    for step in range(300):
        k = int(r.integers(0, 4))
        logits = torch.tensor(r.normal(size=(k + 1, 12)) * 2, dtype=torch.float32)
        q = r.dirichlet(np.ones(12), size=k) if step % 2 and k else None
        tokens = [int(t) for t in r.integers(0, 12, size=k)]
        history = [int(t) for t in r.integers(0, 12, size=5)]
        ours = verify(Draft(tokens, q, "t"), logits, cfg, ours_rng, history=history)
        ref = verify_reference(tokens, q, logits.numpy(), history, ref_rng, cfg.temperature, cfg.top_k, cfg.top_p,
                               cfg.repetition_penalty)
        assert ours == ref, f"step {step}"
