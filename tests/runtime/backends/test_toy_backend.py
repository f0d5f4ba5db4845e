"""A new model backend is one class and one registration: a numpy toy model, written here and nowhere in
the package, runs through the inline loop, overlap and branches (it declares no early exit) and stays
token-equal to its own one-token-at-a-time decoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mirrorsd import Engine, GenerationConfig
from mirrorsd.contracts import CausalLM
from mirrorsd.runtime.backends import BACKENDS, LoadedModel, register_backend
from mirrorsd.runtime.backends.base import PrefixCachedLM


class ToyLM(PrefixCachedLM):
    """A recurrent toy LM in numpy: state_t = tanh(A state_{t-1} + E[token_t]), logits_t = W state_t.
    Its cache is the list of states, so a wrong rollback changes the logits."""

    computes_on = "cpu"
    early_exit = None  # declared: no Mirror-SD early exit (the pipeline runs "branches" as "overlap")
    threads = None  # declared: no thread control (no core sharing)
    exact_batches = True  # declared: one token at a time inside every pass, so batches change nothing

    def __init__(self, vocab_size: int, seed: int, dim: int = 16, max_context: int = 512) -> None:
        super().__init__()
        rng = np.random.default_rng(seed)
        self.backend = f"toy:{seed}"
        self.vocab_size, self.max_context = vocab_size, max_context
        self.embed = rng.normal(size=(vocab_size, dim))
        self.recur = rng.normal(size=(dim, dim)) / np.sqrt(dim)
        self.head = rng.normal(size=(dim, vocab_size)) * 4.0  # peaked distributions
        self.states: list[np.ndarray] = []

    def _feed(self, new: list[int], rows: int) -> torch.Tensor:
        state = self.states[-1] if self.states else np.zeros(self.recur.shape[0])
        for token in new:
            state = np.tanh(self.recur @ state + self.embed[token])
            self.states.append(state)
        self._cached.extend(new)
        return torch.from_numpy(np.stack(self.states[-rows:]) @ self.head).float()  # [rows, V]

    def _drop(self, length: int) -> None:
        del self.states[length:]


def one_at_a_time(lm: ToyLM, prompt: list[int], n: int) -> list[int]:
    """The reference: greedy decoding one token per call, with a fresh cache."""
    lm.reset()
    context = list(prompt)
    for _ in range(n):
        context.append(int(lm.score(context)[-1].argmax()))
    return context[len(prompt):]


@pytest.fixture
def toy_backend(tokenizer):
    """Registers the "toy" backend: the model argument is its seed."""
    def load(spec: str, device=None, dtype=None, progress=False, role="target") -> LoadedModel:
        return LoadedModel(ToyLM(len(tokenizer), seed=int(spec)), tokenizer, frozenset())

    register_backend("toy", load)
    yield "toy"
    del BACKENDS["toy"]


def test_the_toy_model_is_a_causal_lm():
    assert isinstance(ToyLM(10, seed=0), CausalLM)


@pytest.mark.parametrize("mode", ["off", "overlap", "branches"])
@pytest.mark.parametrize("draft", ["0", "1", "ngram"], ids=["self-draft", "other-draft", "ngram"])
def test_a_registered_backend_runs_every_mode_token_equal(mode, draft, toy_backend, tokenizer):
    prompt = tokenizer("def quicksort(arr):\n    if len(arr) <= 1:")["input_ids"]
    expected = one_at_a_time(ToyLM(len(tokenizer), seed=0), prompt, 40)
    engine = Engine.load("0", backend=toy_backend, draft=draft)
    assert engine.target.backend == "toy:0"
    cfg = GenerationConfig(max_new_tokens=40, pipeline=mode)
    # no early exit: "branches" runs as "overlap", except with a draft model's own candidates (branch_source)
    want = "overlap" if mode == "branches" and draft == "ngram" else mode
    assert engine.pipeline_mode(cfg) == want
    assert engine.pipeline_mode(GenerationConfig(pipeline=mode, branch_source="early_exit")) == (
        "overlap" if mode == "branches" else mode)
    for _ in range(2):  # twice: the second request starts from the first one's cache
        result = engine.generate(prompt, cfg)
        assert result.token_ids == expected
    if draft == "0":
        assert result.stats.accepted_tokens > 0  # drafts were verified, not just skipped


def test_sampling_through_a_registered_backend_reproduces_with_a_seed(toy_backend, tokenizer):
    prompt = tokenizer("import numpy as np")["input_ids"]
    engine = Engine.load("0", backend=toy_backend, draft="1")
    runs = [engine.generate(prompt, GenerationConfig(max_new_tokens=30, temperature=1.0, seed=5, pipeline=mode))
            for mode in ("off", "overlap")]
    assert runs[0].token_ids == runs[1].token_ids
