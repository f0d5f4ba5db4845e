"""Tiny real models for fast tests: a byte-level BPE tokenizer trained in-process and 2-layer Llamas."""

from __future__ import annotations

import os

import pytest
import torch

CORPUS = [
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[0]\n",
    "The quick brown fox jumps over the lazy dog. Hello world! Speculative decoding is lossless.",
    "import numpy as np\nfor i in range(10):\n    print(i * 2)\n",
    '{"name": "mirrorsd", "fast": true, "tokens": [1, 2, 3]}',
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer(vocab_size: int = 300, corpus=CORPUS):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_model(tokenizer, seed: int, sharpness: float = 1.0, layers: int = 2, context: int = 256):
    """A random 2-layer Llama; sharpness scales the LM head so distributions are peaked, not uniform."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=48, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def target_model(tokenizer):
    return make_model(tokenizer, seed=0, sharpness=30.0)


@pytest.fixture(scope="session")
def other_model(tokenizer):
    """Same tokenizer, different random weights: a draft that is almost never right."""
    return make_model(tokenizer, seed=1, sharpness=30.0)


@pytest.fixture(scope="module")
def invariance_llama():
    """A random float32 Llama with widths K-quants' 256-wide blocks divide and repacking's 8-row groups fit,
    for the batch-invariance checks (tests copy it before changing it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory, tokenizer):
    """The tiny target saved as a model folder, for code that loads models by path (CLI, examples)."""
    folder = tmp_path_factory.mktemp("tiny")
    make_model(tokenizer, seed=0, sharpness=30.0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def ctrl_c_raises():
    """Ctrl-C (SIGINT) raises KeyboardInterrupt here, as in a terminal, also where the test run was started
    as a background job of a non-interactive shell (`cmd &`), which starts it with SIGINT ignored."""
    import signal

    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.fixture(autouse=True, scope="session")
def _no_hub():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def torch_on_two_threads():
    """torch on two threads (where there are two cores) for a module that runs a catalog model in float32 in the test
    process, as a user's process would: the suite's one thread suits the tiny models, but a smollm2 step reads 540 MB
    of weights, and one thread's share of the memory bandwidth made such modules minutes longer."""
    threads = torch.get_num_threads()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def _user_data(tmp_path_factory):
    """Saved chats and the terminal chat's history go to a scratch folder, never the user's own."""
    os.environ["MIRRORSD_DATA"] = str(tmp_path_factory.mktemp("user-data"))


@pytest.fixture(autouse=True, scope="session")
def _own_calibrations(tmp_path_factory):
    """Measured costs and verdicts go to the run's own file: costs measured while the suite keeps every core busy
    are no guide to the user's later runs, which would otherwise take them from the cache folder."""
    os.environ["MIRRORSD_CALIBRATIONS"] = str(tmp_path_factory.mktemp("calibrations") / "calibrations.json")


@pytest.fixture(scope="module")
def datastore(tmp_path_factory, target_model, tokenizer):
    """A datastore holding the target's own greedy continuations of the first two prompts (and the
    prompts themselves), as if learned from earlier sessions: retrieval drafts get accepted."""
    from helpers import PROMPTS, hf_greedy
    from mirrorsd.runtime.drafters.retrieval.datastore import Datastore

    docs = [tokenizer(p)["input_ids"] + hf_greedy(target_model, tokenizer, p, 60) for p in PROMPTS[:2]]
    return Datastore.create(tmp_path_factory.mktemp("ds"), tokenizer, docs)
