"""The static-shape torch backend (runtime/backends/torch_static.py) on the CPU, the same code a GPU replays as
CUDA graphs: every row of a verify pass equals one-token decoding bit for bit (float32 and bfloat16, Llama,
Qwen2 and Mistral), the cache never shows a pad row, its logits are the model's, and every drafter in every
pipeline mode gives target-only's greedy tokens."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from drafters_for_tests import RandomTokenDrafter
from helpers import PROMPTS, hf_greedy, invariance_tokens
from mirrorsd import Engine, GenerationConfig
from mirrorsd.errors import ConfigError, PromptError
from mirrorsd.runtime.backends.invariance import check_batch_invariance
from mirrorsd.runtime.backends.torch_static import StaticTorchLM
from mirrorsd.runtime.drafters import ChainDrafter, ModelDrafter, NGramDrafter, RetrievalDrafter

TOKENS = invariance_tokens(1024, 300)


def family_model(family: str, dtype=torch.float32):
    """A random 2-layer model of the family, widths as the invariance checks use."""
    import transformers

    config_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                             "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                             "mistral": ("MistralConfig", "MistralForCausalLM")}[family]
    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=None)
    return getattr(transformers, model_cls)(cfg).eval().to(dtype)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_every_row_of_a_verify_pass_equals_one_token_decoding(family):
    lm = StaticTorchLM(family_model(family), "cpu")
    assert lm.exact_batches and not lm.graphed  # the load-time check passed; no graphs off CUDA
    report = check_batch_invariance(lm, TOKENS, offsets=(9, 280))  # passes of 1..17 positions, two prefills
    assert report.exact, report.summary()


def test_bfloat16_rows_are_exact_too():
    lm = StaticTorchLM(family_model("qwen2", torch.bfloat16), "cpu")
    report = check_batch_invariance(lm, TOKENS, offsets=(9, 40), sizes=(1, 2, 5, 16, 17))
    assert lm.exact_batches and report.exact, report.summary()


def test_the_check_can_tell_a_pass_of_another_shape():
    """A draft's configuration (one-row steps, prompts in wider chunks) is not batch-invariant, and the same
    check says so: it is not a check that cannot fail."""
    lm = StaticTorchLM(family_model("llama"), "cpu", rows=1, prefill_rows=16, exact_batches=False)
    report = check_batch_invariance(lm, TOKENS, offsets=(20,), sizes=(1, 4, 9))
    assert not report.exact and report.max_abs_diff < 1e-3, report.summary()


def test_its_logits_are_the_models():
    model = family_model("qwen2")
    lm = StaticTorchLM(model, "cpu", exact_batches=False)
    with torch.no_grad():
        want = model(torch.tensor([TOKENS[:40]])).logits[0]  # [40, V]
    got = lm.score(TOKENS[:30], TOKENS[30:40])  # a 30-token prompt in two passes, then a 10-token draft
    torch.testing.assert_close(got, want[29:], atol=2e-4, rtol=1e-4)


def test_the_cache_holds_only_committed_tokens_after_any_pass():
    """Rejected drafts and pad rows leave cells past the committed length; up to it, the cache equals a cache
    filled by one-token decoding of the committed tokens, bit for bit."""
    model = family_model("llama")
    lm, fresh = StaticTorchLM(model, "cpu", exact_batches=False), StaticTorchLM(model, "cpu", exact_batches=False)
    rng = np.random.default_rng(0)
    committed = list(TOKENS[:5])
    for _ in range(12):
        draft = [int(t) for t in rng.integers(0, 1024, int(rng.integers(0, 20)))]
        rows = lm.score(committed, draft)
        n_accepted = int(rng.integers(0, len(draft) + 1))
        committed += draft[:n_accepted] + [int(rows[n_accepted].argmax())]
        length = len(committed) - 1  # the last committed token is fed by the next pass
        fresh.reset()
        for end in range(1, length + 1):
            fresh.score(committed[:end])
        got, want = lm.cache_cells(length), fresh.cache_cells(length)
        for a, b in zip(got[0] + got[1], want[0] + want[1]):
            assert torch.equal(a, b)


def test_a_long_prompt_then_decoding_equals_transformers(target_model, tokenizer):
    lm = StaticTorchLM(copy.deepcopy(target_model), "cpu")
    engine = Engine(lm, tokenizer)
    engine.eos_ids = frozenset()
    prompt = PROMPTS[0] * 4  # longer than one pass of P rows
    assert len(tokenizer(prompt)["input_ids"]) > lm.rows
    want = hf_greedy(target_model, tokenizer, prompt, 30)
    assert engine.generate(prompt, GenerationConfig(max_new_tokens=30)).token_ids == want


def test_the_context_limit_is_the_static_cache():
    lm = StaticTorchLM(family_model("llama"), "cpu", max_context=64, exact_batches=False)
    assert lm.max_context == 64
    lm.score(TOKENS[:50], TOKENS[50:64])  # up to the limit; the pad rows fit past it
    with pytest.raises(PromptError, match="context window of 64"):
        lm.score(TOKENS[:60], TOKENS[60:65])


def test_an_unsupported_family_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).eval()
    with pytest.raises(ConfigError, match="Llama, Qwen2 and Mistral"):
        StaticTorchLM(model, "cpu")


def drafters(kind, target_model, other_model, tokenizer, datastore):
    return {"none": lambda: None,
            "self": lambda: ModelDrafter(StaticTorchLM(target_model, "cpu", rows=1, prefill_rows=16,
                                                       exact_batches=False)),
            "other-model": lambda: ModelDrafter(StaticTorchLM(other_model, "cpu", rows=1, prefill_rows=16,
                                                              exact_batches=False)),
            "random": lambda: RandomTokenDrafter(len(tokenizer)),
            "ngram": lambda: NGramDrafter(max_ngram=3, min_ngram=1),
            "retrieval": lambda: RetrievalDrafter(datastore),
            "chain": lambda: ChainDrafter(NGramDrafter(), RetrievalDrafter(datastore))}[kind]()


@pytest.fixture(scope="module")
def static_target(target_model):
    return StaticTorchLM(copy.deepcopy(target_model), "cpu")


@pytest.mark.parametrize("kind", ["self", "other-model", "random", "ngram", "retrieval", "chain"])
def test_every_drafter_and_mode_gives_target_onlys_greedy_tokens(kind, static_target, target_model, other_model,
                                                                  tokenizer, datastore):
    assert static_target.exact_batches
    plain = Engine(static_target, tokenizer)
    plain.eos_ids = frozenset()
    spec = plain.with_drafter(drafters(kind, target_model, other_model, tokenizer, datastore))
    for prompt in PROMPTS:
        want = plain.generate(prompt, GenerationConfig(max_new_tokens=40)).token_ids
        assert want == hf_greedy(target_model, tokenizer, prompt, 40), prompt
        for pipeline in ("off", "overlap", "branches"):
            cfg = GenerationConfig(max_new_tokens=40, num_draft_tokens=6, adaptive_k=False, pipeline=pipeline)
            result = spec.generate(prompt, cfg)
            assert result.token_ids == want, (pipeline, prompt)
            assert result.stats.drafted_tokens > 0 or kind in ("ngram", "retrieval", "chain"), (pipeline, prompt)


def test_a_seeded_sampled_run_is_the_same_in_every_mode(static_target, other_model, tokenizer):
    spec = Engine(static_target, tokenizer).with_drafter(
        ModelDrafter(StaticTorchLM(other_model, "cpu", rows=1, prefill_rows=16, exact_batches=False)))
    spec.eos_ids = frozenset()
    runs = {pipeline: spec.generate(PROMPTS[1], GenerationConfig(max_new_tokens=30, temperature=0.9, seed=7,
                                                                 num_draft_tokens=4, pipeline=pipeline))
            for pipeline in ("off", "overlap", "branches")}
    assert runs["off"].stats.drafted_tokens > 0
    assert runs["off"].token_ids == runs["overlap"].token_ids == runs["branches"].token_ids


def test_the_torch_static_backend_loads_a_folder_and_keeps_its_verdict(tiny_folder, tmp_path, monkeypatch):
    from mirrorsd.runtime.backends import load_lm
    from mirrorsd.runtime.decode.policy.calibrate import CalibrationStore

    monkeypatch.setenv("MIRRORSD_CACHE", str(tmp_path))
    monkeypatch.delenv("MIRRORSD_CALIBRATIONS", raising=False)  # the default place, in the cache folder
    target = load_lm(str(tiny_folder), "torch-static", device="cpu").lm
    assert isinstance(target, StaticTorchLM) and target.exact_batches and target.rows == 16
    assert target.dtype == torch.float32  # the CPU's default; bfloat16 is the GPU's
    store = CalibrationStore(tmp_path / "calibrations.json")
    (key,) = [k for k in store._read() if k.startswith("invariance of")]
    store.put_verdict(key, False)  # the kept verdict is what a later load declares
    assert not load_lm(str(tiny_folder), "torch-static", device="cpu").lm.exact_batches
    draft = load_lm(str(tiny_folder), "torch-static", device="cpu", role="draft").lm
    assert draft.rows == 1 and not draft.exact_batches


def test_a_cancelled_request_stops_within_a_chunk_of_its_prompt():
    import threading

    from mirrorsd.errors import RequestCancelled

    lm = StaticTorchLM(family_model("llama"), "cpu")
    passes = []
    run = lm._passes[lm.rows].run
    lm._passes[lm.rows].run = lambda ids, start: passes.append(len(ids)) or run(ids, start)
    lm.cancel = threading.Event()
    lm.cancel.set()
    with pytest.raises(RequestCancelled):
        lm.score(list(TOKENS[:100]), [])
    assert passes == [lm.rows]  # one chunk of the prompt, not its 100 tokens
    lm.cancel = None
    assert lm.score(list(TOKENS[:100]), []).shape[0] == 1
