"""mirrorsd's drafters as vLLM custom_class proposers: built from a VllmConfig's fields, one draft per request of
a batch laid out as vLLM's model runner passes it (its token-id buffer and per-request lengths), none for a request
that sampled nothing or is at the context limit. A real vLLM serving them: scripts/vllm_handoff_check.py."""

from __future__ import annotations

import importlib
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from mirrorsd.drafters import ChainDrafter, Datastore, NGramDrafter, RetrievalDrafter, build_datastore
from mirrorsd.apps.handoff.vllm_proposer import DATASTORE_ENV, ChainProposer, RetrievalProposer

CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"


@pytest.fixture
def datastore(tmp_path, tokenizer, monkeypatch):
    corpus = tmp_path / "corpus.py"
    corpus.write_text(CODE)
    build_datastore([corpus], tokenizer, tmp_path / "ds")
    monkeypatch.setenv(DATASTORE_ENV, str(tmp_path / "ds"))
    return tmp_path / "ds"


def vllm_config(tokenizer_folder, k=4, max_model_len=64):
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                           model_config=SimpleNamespace(max_model_len=max_model_len, tokenizer=str(tokenizer_folder)))


def batch(rows: list[list[int]], width: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's layout: token ids [max_num_reqs, max_model_len] (int32) and each request's length."""
    ids = np.zeros((len(rows) + 1, width), dtype=np.int32)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = row
    return ids, np.array([len(r) for r in rows] + [0])


@pytest.mark.parametrize("proposer, reference", [
    (ChainProposer, lambda store: ChainDrafter(NGramDrafter(), RetrievalDrafter(store))),
    (RetrievalProposer, lambda store: RetrievalDrafter(store)),
])
def test_each_request_gets_our_drafters_draft(proposer, reference, datastore, tokenizer, tiny_folder):
    ids = tokenizer(CODE, add_special_tokens=False)["input_ids"]
    rows = [ids[:12], ids[:20], ids[:7]]
    token_ids, lengths = batch(rows)
    drafts = proposer(vllm_config(tiny_folder)).propose([[1], [2], []], lengths, token_ids)
    ours = reference(Datastore.open(datastore, tokenizer))
    assert drafts[:2] == [list(ours.propose(rows[0], 4).tokens), list(ours.propose(rows[1], 4).tokens)]
    assert any(drafts[:2]) and all(len(d) <= 4 for d in drafts)
    assert drafts[2] == []  # sampled nothing this step


def test_no_draft_past_the_context_limit(datastore, tokenizer, tiny_folder):
    ids = tokenizer(CODE, add_special_tokens=False)["input_ids"]
    token_ids, lengths = batch([ids[:20]])
    limited = ChainProposer(vllm_config(tiny_folder, k=8, max_model_len=23))
    assert len(limited.propose([[5]], lengths, token_ids)[0]) <= 2
    assert ChainProposer(vllm_config(tiny_folder, max_model_len=21)).propose([[5]], lengths, token_ids) == [[]]


def test_the_old_module_path_reads_on_with_a_deprecation_warning():
    """Handoff folders written before the proposers moved beside `mirrorsd handoff` name mirrorsd.vllm_proposer."""
    sys.modules.pop("mirrorsd.vllm_proposer", None)
    with pytest.warns(DeprecationWarning, match="mirrorsd.apps.handoff.vllm_proposer"):
        old = importlib.import_module("mirrorsd.vllm_proposer")
    assert (old.ChainProposer, old.RetrievalProposer, old.DATASTORE_ENV) == (ChainProposer, RetrievalProposer,
                                                                             DATASTORE_ENV)
