"""llama.cpp's fixed-shape passes (LlamaCppLM(fixed_rows=P), the `llamacpp-static` backend, what llama.cpp runs on a
GPU), here on the CPU with llama.cpp's stock kernels, which are not batch-invariant at varying shapes (a Q4_K_M
model: the repacked GEMM and the tiled K-quant matmul): with every pass P rows, every row of a verify pass equals
one-token decoding bit for bit, pads never reach the cache, every drafter in every pipeline mode gives
target-only's greedy tokens, a model draft's one shape keeps a seeded sampled run the same in every mode, and the
backend measures its verdict once and keeps it."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

from drafters_for_tests import RandomTokenDrafter  # noqa: E402
from gguf_files import write_llama_gguf  # noqa: E402
from helpers import PROMPTS, invariance_tokens  # noqa: E402
from mirrorsd import Engine, GenerationConfig  # noqa: E402
from mirrorsd.runtime.backends import invariance_verdict, load_lm  # noqa: E402
from mirrorsd.runtime.backends.invariance import check_batch_invariance, check_fixed_shape  # noqa: E402
from mirrorsd.runtime.backends.llamacpp_lm import LlamaCppLM  # noqa: E402
from mirrorsd.runtime.drafters import ModelDrafter, NGramDrafter  # noqa: E402
from test_invariance import quantize  # noqa: E402
from test_llamacpp import tiny_llama  # noqa: E402

TOKENS = invariance_tokens(300, 64)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("static")
    f32 = write_llama_gguf(tiny_llama(tokenizer, seed=0, hidden=256), folder / "wide.gguf")
    return quantize(f32, folder / "target-q4km.gguf", 15)


def stock(gguf, **kw) -> LlamaCppLM:
    return LlamaCppLM(gguf, threads=2, n_ctx=512, exact=False, flash_attn=True, **kw)


@pytest.fixture(scope="module")
def fixed(gguf):
    lm = stock(gguf, fixed_rows=16)
    yield lm
    lm.close()


def test_one_shape_makes_the_stock_kernels_batch_invariant(gguf, fixed):
    any_shape = stock(gguf)
    varying = check_batch_invariance(any_shape, TOKENS, offsets=(3,), sizes=(1, 4, 9, 16))
    any_shape.close()
    assert not varying.exact, varying.summary()  # the same check tells the stock kernels' shapes apart
    assert fixed.backend == "llamacpp-static:cpu" and not fixed.exact_batches  # undeclared until checked
    assert check_fixed_shape(fixed, 16)  # passes of 1..17 positions (17: two passes), at 241 across 256 cells


def test_pads_never_reach_the_cache(gguf, fixed):
    """After any pass llama.cpp's memory holds exactly the tokens fed, no pad's cell; after the rollbacks of
    rejected drafts the next row equals one-token decoding of the committed tokens."""
    api = fixed._api
    memory = api.llama_get_memory(fixed.llm.ctx)
    rng = np.random.default_rng(0)
    committed = TOKENS[:5]
    fixed.reset()
    for _ in range(8):
        draft = [int(t) for t in rng.integers(0, fixed.vocab_size, int(rng.integers(0, 20)))]
        rows = fixed.score(committed, draft)
        assert api.llama_memory_seq_pos_max(memory, 0) == len(committed) + len(draft) - 1  # no pad cell
        n_accepted = int(rng.integers(0, len(draft) + 1))
        committed = committed + draft[:n_accepted] + [int(rows[n_accepted].argmax())]
    reference = stock(gguf, fixed_rows=16)
    for end in range(1, len(committed)):
        reference.score(committed[:end])
    assert np.array_equal(reference.score(committed)[-1].numpy(), fixed.score(committed)[-1].numpy())
    reference.close()


@pytest.fixture(scope="module")
def static_target(gguf):
    lm = stock(gguf, fixed_rows=16)
    lm.exact_batches = check_fixed_shape(lm, 16)
    yield lm
    lm.close()


@pytest.mark.parametrize("kind", ["ngram", "self", "other-model", "random"])
def test_every_drafter_and_mode_gives_target_onlys_greedy_tokens(kind, static_target, gguf, tokenizer,
                                                                  tmp_path_factory):
    assert static_target.exact_batches
    plain = Engine(static_target, tokenizer)
    plain.eos_ids = frozenset()
    other = write_llama_gguf(tiny_llama(tokenizer, seed=1, hidden=256), tmp_path_factory.mktemp("draft") / "d.gguf")
    drafter = {"ngram": lambda: NGramDrafter(max_ngram=3, min_ngram=1),
               # on the stock kernels as the target: the CPU's kernel mode is process-wide (ggml_kernels.py)
               "self": lambda: ModelDrafter(stock(gguf)),
               "other-model": lambda: ModelDrafter(stock(other)),
               "random": lambda: RandomTokenDrafter(len(tokenizer))}[kind]()
    spec = plain.with_drafter(drafter)
    for prompt in PROMPTS:
        want = plain.generate(prompt, GenerationConfig(max_new_tokens=32)).token_ids
        for pipeline in ("off", "overlap"):
            cfg = GenerationConfig(max_new_tokens=32, num_draft_tokens=6, adaptive_k=False, pipeline=pipeline)
            result = spec.generate(prompt, cfg)
            assert result.token_ids == want, (kind, pipeline, prompt)
            assert result.stats.drafted_tokens > 0 or kind == "ngram", (pipeline, prompt)


def test_the_backend_declares_what_the_check_found_and_auto_speculates():
    """The catalog model on `--backend llamacpp-static`: the check runs at the first load, later loads read its
    verdict, `auto` speculates, and a draft on the backend runs passes of any shape (they need no exactness)."""
    engine = Engine.load(target="smollm2-135m", backend="llamacpp-static")
    assert engine.target.backend == "llamacpp-static:cpu" and engine.target.fixed_rows == 16
    assert engine.target.exact_batches and engine.drafter is not None
    engine.close()
    draft = load_lm("smollm2-135m", "llamacpp-static", role="draft").lm
    # the target's kernels, and its shape
    assert draft.fixed_rows == 16 and draft.backend == "llamacpp-static:cpu" and not draft.exact
    draft.close()


def test_a_seeded_sampled_run_is_the_same_in_every_mode_and_after_other_requests():
    """A model draft on the backend runs its one shape too, so its probabilities do not depend on which tokens its
    cache took in which pass (a cached prefix, a mode's catch-up): on a fresh engine and again after other runs, a
    seeded sampled run is the same in every pipeline mode. (Drafts of any shape parted here: the fresh run's
    tokens from the later runs' at the 26th.)"""
    from mirrorsd.apps.bench.prompt_suite import bundled_suite

    request = bundled_suite(1)[0].request  # HumanEval/0
    engine = Engine.load("smollm2-135m", backend="llamacpp-static", draft="smollm2-135m", draft_device="cpu")
    assert engine.drafter.lm.fixed_rows == 16
    runs = [engine.generate(request, GenerationConfig(max_new_tokens=64, temperature=0.8, seed=1, pipeline=mode))
            for _ in range(2) for mode in ("off", "overlap", "branches")]
    engine.close()
    assert all(r.stats.drafted_tokens > 0 for r in runs)
    assert len({tuple(r.token_ids) for r in runs}) == 1, [r.token_ids for r in runs]


def test_a_verdict_is_measured_once_and_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("MIRRORSD_CACHE", str(tmp_path))
    monkeypatch.delenv("MIRRORSD_CALIBRATIONS", raising=False)  # the default place, in the cache folder
    checks = []
    assert invariance_verdict("invariance of a model", lambda: checks.append(1) or True)
    assert invariance_verdict("invariance of a model", lambda: checks.append(1) or False)  # kept: not re-checked
    assert not invariance_verdict("invariance of another model", lambda: checks.append(1) or False)
    assert len(checks) == 2


def test_a_verdict_on_llamacpps_kernels_is_kept_whatever_torchs_thread_count(tmp_path, monkeypatch):
    """llama.cpp's passes do not run on torch's threads: a process with another torch thread count (a script, the
    CLI beside the SDK) reads the verdict instead of checking again; a torch backend's verdict is its threads' own."""
    import torch

    monkeypatch.setenv("MIRRORSD_CALIBRATIONS", str(tmp_path / "calibrations.json"))
    threads, checks = torch.get_num_threads(), []
    try:
        for n in (threads, threads + 1):
            torch.set_num_threads(n)
            assert invariance_verdict("llama.cpp's", lambda: checks.append("llama.cpp") or n == threads,
                                      torch_threads=False)
            assert invariance_verdict("torch's", lambda: checks.append("torch") or True)
    finally:
        torch.set_num_threads(threads)
    assert checks == ["llama.cpp", "torch", "torch"]


def test_a_llamacpp_load_imports_no_torch_model_code():
    """The fixed-shape option costs a GGUF load nothing at start-up: no transformers modelling code (seconds)."""
    import subprocess
    import sys

    code = ("import sys; from mirrorsd.runtime.backends import load_lm; load_lm('smollm2-135m', 'llamacpp'); "
            "print(sorted(m for m in sys.modules if m in ('transformers.modeling_utils', "
            "'mirrorsd.runtime.backends.torch_static')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
