"""The llama.cpp backend on tiny GGUF files written in the test (float32, Q8_0 and K-quants): greedy tokens
exactly those of its own one-token-at-a-time decoding in every mode and with every drafter (its batch-
invariant kernels: test_invariance.py), a model drafting for itself accepted in full, the same model as
torch on float32 weights, rollback against a fresh cache, the sampling distribution, and bad input."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from drafters_for_tests import RandomTokenDrafter
from gguf_files import write_llama_gguf
from helpers import assert_distribution
from mirrorsd import Engine, GenerationConfig
from mirrorsd.errors import ConfigError, ModelNotFoundError
from mirrorsd.runtime.drafters import ModelDrafter, NGramDrafter

pytest.importorskip("llama_cpp", reason="the llama.cpp backend is in the test extra: bash scripts/setup.sh installs it")
from mirrorsd.runtime.backends.llamacpp_lm import LlamaCppLM  # noqa: E402

PROMPT = "def quicksort(arr):\n    if len(arr) <= 1:"


def tiny_llama(tokenizer, seed: int, sharpness: float = 30.0, hidden: int = 64):
    """Like conftest's tiny Llama, with widths that Q8_0's 32-wide blocks (hidden=256: K-quants' 256-wide
    ones) divide."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    return model


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory, tokenizer):
    from test_invariance import quantize

    folder = tmp_path_factory.mktemp("gguf")
    target, draft = tiny_llama(tokenizer, seed=0), tiny_llama(tokenizer, seed=1)
    f32 = write_llama_gguf(target, folder / "target-f32.gguf")
    return {"target": target, "F32": f32,
            "Q8_0": write_llama_gguf(target, folder / "target-q8.gguf", quant="Q8_0"),
            "Q4_K_M": quantize(write_llama_gguf(tiny_llama(tokenizer, seed=0, hidden=256), folder / "wide.gguf"),
                               folder / "target-q4km.gguf", 15),
            "draft": write_llama_gguf(draft, folder / "draft-q8.gguf", quant="Q8_0")}


def one_at_a_time(lm: LlamaCppLM, prompt: list[int], n: int) -> list[int]:
    """The reference: greedy, one token per call, from a fresh cache."""
    lm.reset()
    context = list(prompt)
    for _ in range(n):
        context.append(int(lm.score(context)[-1].argmax()))
    return context[len(prompt):]


def test_it_is_the_models_own_float32_decoding(ggufs, tokenizer):
    """On float32 weights llama.cpp and torch run the same model: greedy outputs agree."""
    ids = tokenizer(PROMPT)["input_ids"]
    lm = LlamaCppLM(ggufs["F32"], threads=1)
    ours = one_at_a_time(lm, ids, 30)
    with torch.no_grad():
        out = ggufs["target"].generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False, eos_token_id=None)
    assert ours == out[0, len(ids):].tolist()
    assert lm.backend == "llamacpp:cpu" and lm.computes_on == "cpu" and lm.vocab_size == len(tokenizer)


@pytest.mark.parametrize("quant", ["F32", "Q8_0", "Q4_K_M"])
@pytest.mark.parametrize("mode", ["off", "overlap", "branches"])
@pytest.mark.parametrize("drafter", ["self", "other", "ngram", "random"])
def test_greedy_equals_its_own_one_token_decoding_in_every_mode(quant, mode, drafter, ggufs, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    lm = LlamaCppLM(ggufs[quant], threads=1)
    expected = one_at_a_time(lm, ids, 40)
    make = {"self": lambda: ModelDrafter(LlamaCppLM(ggufs[quant], threads=1)),
            "other": lambda: ModelDrafter(LlamaCppLM(ggufs["draft"], threads=1)),
            "ngram": NGramDrafter, "random": lambda: RandomTokenDrafter(len(tokenizer))}
    engine = Engine(lm, tokenizer, make[drafter](), eos_ids=frozenset())
    cfg = GenerationConfig(max_new_tokens=40, pipeline=mode)
    # no early exit: "branches" runs as "overlap", except with a draft model's own candidates (branch_source)
    model_draft = drafter in ("self", "other")
    assert engine.pipeline_mode(cfg) == ("overlap" if mode == "branches" and not model_draft else mode)
    for _ in range(2):  # the second request starts from the first one's cache
        result = engine.generate(ids, cfg)
        assert result.token_ids == expected
    assert result.stats.backend == "llamacpp:cpu"
    if drafter == "self":  # its own tokens, decoded one at a time: every one of them is accepted
        drafted, accepted = result.stats.drafter_tokens[engine.drafter.name]
        assert drafted > 0 and accepted == drafted


def test_rollback_matches_a_fresh_cache(ggufs, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    lm, fresh = LlamaCppLM(ggufs["Q8_0"], threads=1), LlamaCppLM(ggufs["Q8_0"], threads=1)
    lm.score(ids, [5, 6, 7, 8])  # a draft that gets rejected
    rolled = lm.score(ids + [9], [10, 11])  # drops 5..8 from the KV cache, feeds 9, 10, 11
    assert lm._cached == ids + [9, 10, 11]
    again = fresh.score(ids + [9], [10, 11])
    assert rolled.shape == (3, len(tokenizer))
    assert torch.equal(rolled, again)  # bit for bit: the rolled-back cache is a fresh one


def test_sampling_through_llamacpp_matches_its_own_distribution(ggufs, tokenizer):
    """Speculative sampling with a llama.cpp draft reproduces the llama.cpp target's distribution of the
    first two tokens (chi-square), the draft proposing every step."""
    ids = tokenizer("The quick brown fox")["input_ids"]
    lm = LlamaCppLM(ggufs["Q8_0"], threads=1)
    temp = 0.8
    p1 = torch.softmax(lm.score(ids)[-1] / temp, -1).double().numpy()
    p2 = sum(p1[t] * torch.softmax(lm.score(ids + [t])[-1] / temp, -1).double().numpy()
             for t in np.flatnonzero(p1 > 1e-9))
    engine = Engine(lm, tokenizer, ModelDrafter(LlamaCppLM(ggufs["draft"], threads=1)), eos_ids=frozenset())
    cfg = GenerationConfig(temperature=temp, max_new_tokens=2, num_draft_tokens=2, adaptive_k=False)
    assert_distribution(engine, ids, cfg, p1, p2, seeds=1200, min_drafted=1000)


def test_a_corrupt_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with pytest.raises(ModelNotFoundError) as err:
        LlamaCppLM(bad)
    assert "could not load broken.gguf" in err.value.message and "--backend torch" in err.value.hint


def test_a_damaged_gguf_given_by_path_is_refused_on_the_first_pass(ggufs, tokenizer, tmp_path):
    """Damage no stat record sees (a .gguf given by path is never hashed): weights overwritten with NaNs make
    the first pass's logits NaN, and the request is refused instead of decoding token 0 over and over."""
    from mirrorsd.errors import ModelOutputError

    ids = tokenizer(PROMPT)["input_ids"]
    expected = Engine(LlamaCppLM(ggufs["F32"], threads=1), tokenizer, None).generate(ids, max_new_tokens=4)
    assert len(expected.token_ids) == 4  # the intact file answers
    data = bytearray(ggufs["F32"].read_bytes())
    middle = len(data) // 2
    data[middle: middle + 4096] = b"\xff" * 4096  # float32 NaNs in the middle of the weights, same size
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(bytes(data))
    for drafter in (None, NGramDrafter()):
        engine = Engine(LlamaCppLM(damaged, threads=1), tokenizer, drafter)
        with pytest.raises(ModelOutputError, match="NaN or infinite"):
            engine.generate(ids, max_new_tokens=4)


def test_a_gpu_device_on_a_cpu_only_build_is_refused_before_anything_loads(tmp_path):
    """--device cuda on a llama.cpp build without GPU offload would run on the CPU and say nothing."""
    import llama_cpp

    from mirrorsd.runtime.backends import load_lm

    if llama_cpp.llama_supports_gpu_offload():
        pytest.skip("this llama-cpp-python build offloads to a GPU")
    with pytest.raises(ConfigError, match="runs on the CPU only") as err:
        load_lm(str(tmp_path / "not-even-a-file.gguf"), "llamacpp", device="cuda")
    assert "--device cpu" in err.value.hint
    # the auto backend takes the GPU to torch instead, which says whether it sees one
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="torch sees no CUDA GPU"):
            load_lm(str(tmp_path / "not-even-a-file.gguf"), "auto", device="cuda")


def test_a_gguf_of_an_unknown_architecture_is_a_clear_error(tmp_path, tokenizer):
    import gguf

    path = tmp_path / "alien.gguf"
    writer = gguf.GGUFWriter(str(path), "not-an-architecture")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelNotFoundError) as err:
        LlamaCppLM(path)
    assert "alien.gguf" in err.value.message


def test_without_llama_cpp_python_the_error_names_the_extra(monkeypatch, ggufs):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now raises ImportError
    with pytest.raises(ConfigError) as err:
        Engine.load(str(ggufs["Q8_0"]), backend="llamacpp", draft="none")
    assert "llama-cpp-python" in err.value.message and "mirrorsd[llamacpp]" in err.value.hint


def test_auto_picks_llamacpp_for_gguf_models_only(ggufs, tiny_folder):
    from mirrorsd.runtime.backends import auto_backend

    assert auto_backend("smollm2-135m") == "llamacpp" and auto_backend(str(ggufs["Q8_0"])) == "llamacpp"
    assert auto_backend(str(tiny_folder)) == "torch"


def test_a_cancelled_request_stops_within_a_chunk_of_its_prompt(tokenizer, tmp_path, monkeypatch):
    """A server's client that left during a long prefill kept the engine busy to the prefill's end: the
    backend checks the request's cancel flag between its 512-token chunks."""
    import threading

    import llama_cpp

    from mirrorsd.errors import RequestCancelled

    model = tiny_llama(tokenizer, seed=0)
    model.config.max_position_embeddings = 2048
    lm = LlamaCppLM(write_llama_gguf(model, tmp_path / "long.gguf"), threads=1, n_ctx=2048)
    engine = Engine(lm, tokenizer, None)
    prompt = [int(t) % (len(tokenizer) - 10) + 5 for t in range(1500)]  # three chunks of 512
    calls = []
    decode = llama_cpp.llama_decode
    monkeypatch.setattr(llama_cpp, "llama_decode", lambda *a: calls.append(1) or decode(*a))
    cancel = threading.Event()
    cancel.set()  # as if the client had left while the request waited
    with pytest.raises(RequestCancelled):
        list(engine.stream(prompt, GenerationConfig(max_new_tokens=4), cancel=cancel))
    assert len(calls) == 1  # one chunk, not the whole prompt
    whole = engine.generate(prompt, GenerationConfig(max_new_tokens=4))  # the engine goes on; the cache was reset
    assert len(whole.token_ids) == 4 and len(calls) >= 1 + 3
    assert lm.cancel is None  # the flag is the request's only
