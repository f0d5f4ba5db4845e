"""Batch invariance, measured (runtime/backends/invariance.py): on llama.cpp with the batch-invariant kernels,
every row of a verify pass of 1..17 positions equals one-token decoding bit for bit, for each weight type
whose stock kernels differ (K-quants through the tiled matmul, Q4_0 / Q4_K repacked into GEMM layouts,
Q8_0 through tinyBLAS, F32), at cache offsets past ggml's 256-cell padding and after chunked prefills;
with llama.cpp's stock kernels the same check fails, so the check can tell."""

from __future__ import annotations

import pytest
import torch

from gguf_files import write_llama_gguf
from helpers import invariance_tokens
from mirrorsd.runtime.backends.invariance import check_batch_invariance

pytest.importorskip("llama_cpp", reason="the llama.cpp backend is in the test extra: bash scripts/setup.sh installs it")
from mirrorsd.runtime.backends.ggml_kernels import batch_invariant_switch  # noqa: E402
from mirrorsd.runtime.backends.llamacpp_lm import LlamaCppLM  # noqa: E402

QUANTS = {"Q4_K_M": 15, "Q6_K": 18, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7}  # llama_ftype values
TOKENS = invariance_tokens(1000, 300)  # past 256: KV views of 512 cells


def quantize(src, dst, ftype: int):
    """llama.cpp's own quantizer (llama_model_quantize), as llama-quantize runs it."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 1
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) == 0
    return dst


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory, invariance_llama):
    folder = tmp_path_factory.mktemp("quants")
    f32 = write_llama_gguf(invariance_llama, folder / "tiny-f32.gguf")
    return {"F32": f32, **{q: quantize(f32, folder / f"tiny-{q}.gguf", t) for q, t in QUANTS.items()}}


def test_the_build_has_the_batch_invariant_kernels():
    """scripts/setup.sh builds llama.cpp with scripts/patches/ggml-cpu-batch-invariant.patch."""
    assert batch_invariant_switch() is not None


@pytest.mark.parametrize("quant", ["F32", *QUANTS])
def test_every_row_of_a_verify_pass_equals_one_token_decoding(quant, ggufs):
    lm = LlamaCppLM(ggufs[quant], threads=2, n_ctx=512)
    assert lm.exact_batches
    report = check_batch_invariance(lm, TOKENS, offsets=(9, 280))
    assert report.exact, report.summary()
    assert report.by_size == dict.fromkeys(range(1, 18), 0.0)


@pytest.mark.parametrize("quant", ["Q4_K_M", "Q6_K"])
def test_every_row_is_exact_with_repacking_off(quant, ggufs):
    """K-quant weights in their own layout (repack off) go through the multi-row vec_dot kernels instead of the
    repacked GEMV: exact too."""
    lm = LlamaCppLM(ggufs[quant], threads=2, n_ctx=512, repack=False)
    report = check_batch_invariance(lm, TOKENS, offsets=(9, 280))
    assert lm.exact_batches and report.exact, report.summary()


def test_stock_kernels_fail_the_same_check(ggufs):
    """The check can fail: llama.cpp's stock batched kernels (the repacked Q4_K GEMM, and with AVX-512 the tiled
    K-quant matmul of the Q6_K head) give a batch's rows other logits than one-token decoding, and the backend does
    not claim otherwise. (The tiny Q4_0, Q4_1 and Q8_0 files differed only in their Q6_K head, which on AVX2 the patch
    repacks for its GEMV, the one kernel that layout has there in either mode.)"""
    lm = LlamaCppLM(ggufs["Q4_K_M"], threads=2, n_ctx=512, exact=False)
    assert not lm.exact_batches
    report = check_batch_invariance(lm, TOKENS, offsets=(9,), sizes=(1, 4, 8, 16))
    assert not report.exact and report.by_size[16] > 0, report.summary()


def test_the_exact_backend_stays_exact_beside_a_stock_one(ggufs):
    """The batch-invariant mode is process-wide; each pass sets it as its backend needs, so a stock Llama
    running in between (bench's peer) changes nothing."""
    exact = LlamaCppLM(ggufs["Q4_K_M"], threads=2, n_ctx=512)
    stock = LlamaCppLM(ggufs["Q4_K_M"], threads=2, n_ctx=512, exact=False)
    stock.score(TOKENS[:40])
    assert check_batch_invariance(exact, TOKENS, offsets=(9,), sizes=(8, 16)).exact
