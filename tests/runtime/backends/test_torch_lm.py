"""The torch backend (runtime/backends/torch_lm.py): a long prompt goes in chunks, and a request whose client
left stops after the chunk it is in; chunked or whole, the prompt leaves the same cache and logits."""

from __future__ import annotations

import threading

import pytest
import torch

from mirrorsd import Engine, GenerationConfig
from mirrorsd.errors import RequestCancelled
from mirrorsd.runtime.backends.torch_lm import TorchCausalLM


def counted(lm: TorchCausalLM) -> list[int]:
    """The lengths of the forward passes lm runs from now on."""
    calls: list[int] = []
    forward = lm._forward
    lm._forward = lambda new, rows, exit_request: calls.append(len(new)) or forward(new, rows, exit_request)
    return calls


def test_a_cancelled_request_stops_within_a_chunk_of_its_prompt(target_model, tokenizer):
    lm = TorchCausalLM(target_model)
    lm.prefill_chunk = 32
    engine = Engine(lm, tokenizer, None)
    prompt = [int(t) % (len(tokenizer) - 10) + 5 for t in range(150)]  # four chunks of 32, then the rest
    calls = counted(lm)
    cancel = threading.Event()
    cancel.set()  # as if the client had left while the request waited
    with pytest.raises(RequestCancelled):
        list(engine.stream(prompt, GenerationConfig(max_new_tokens=4), cancel=cancel))
    assert calls == [32]  # one chunk, not the whole prompt
    whole = engine.generate(prompt, GenerationConfig(max_new_tokens=4))  # the engine goes on
    assert len(whole.token_ids) == 4 and lm.cancel is None


def test_a_chunked_prompt_gives_the_logits_of_a_whole_one(target_model):
    """The tiny model runs torch's batch-invariant float32 kernels: chunking the prompt changes no bit."""
    prompt = [int(t) % 290 + 5 for t in range(100)]
    whole, chunked = TorchCausalLM(target_model), TorchCausalLM(target_model)
    whole.prefill_chunk = 1000
    chunked.prefill_chunk = 16
    calls = counted(chunked)
    assert torch.equal(whole.score(prompt, [7, 8]), chunked.score(prompt, [7, 8]))
    assert calls == [16] * 6 + [6]  # six chunks, then the last 4 prompt tokens and the 2 drafted ones
    assert torch.equal(whole.score(prompt + [7, 8], [9]), chunked.score(prompt + [7, 8], [9]))
