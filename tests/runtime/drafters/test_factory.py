"""make_drafter's specs and objects, and the abilities each drafter declares (model, learner, ranking)."""

from __future__ import annotations

import pytest

from mirrorsd.errors import ConfigError
from mirrorsd.runtime.backends.torch_lm import TorchCausalLM
from mirrorsd.runtime.drafters.chain import ChainDrafter
from mirrorsd.runtime.drafters.factory import helper_for, make_drafter
from mirrorsd.runtime.drafters.model import ModelDrafter
from mirrorsd.runtime.drafters.ngram import NGramDrafter
from mirrorsd.runtime.drafters.retrieval.datastore import build_datastore
from mirrorsd.runtime.drafters.retrieval.drafter import RetrievalDrafter


@pytest.mark.parametrize("obj", [42, object(), NGramDrafter.propose])
def test_an_object_that_is_not_a_drafter_is_refused_naming_what_it_lacks(obj, tokenizer):
    with pytest.raises(ConfigError, match="lacks .*propose") as err:
        make_drafter(obj, tokenizer)
    assert "model/learner may be None" in err.value.hint


def test_a_drafter_object_is_taken_as_it_is(tokenizer):
    drafter = NGramDrafter()
    assert make_drafter(drafter, tokenizer) is drafter


def test_model_free_drafters_declare_no_model_and_learn_only_from_a_datastore_of_yours(tokenizer, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("def f(x):\n    return x + 1\n")
    store = build_datastore([corpus], tokenizer, tmp_path / "ds")
    ngram, shipped, yours = NGramDrafter(), RetrievalDrafter(store), RetrievalDrafter(store, learn=True)
    assert ngram.model is None and ngram.learner is None
    assert shipped.model is None and shipped.learner is None
    assert yours.learner is yours
    assert ChainDrafter(NGramDrafter(), shipped).learner is None
    chain = ChainDrafter(NGramDrafter(), yours)
    assert chain.learner is chain and chain.model is None
    before = store.num_tokens
    chain.learner.finish([1, 2], [3, 4, 5])
    assert store.num_tokens > before + 2  # the reply (and a separator)
    assert helper_for(chain) is None


def test_a_model_drafter_declares_its_model_and_ranking_and_gets_an_ngram_fallback(target_model):
    drafter = ModelDrafter(TorchCausalLM(target_model))
    assert drafter.model is drafter and drafter.model.ranking is drafter and drafter.learner is None
    assert isinstance(helper_for(drafter), NGramDrafter)


def test_auto_with_no_export_in_the_cache_asks_for_no_devices(tokenizer, tmp_path, monkeypatch):
    """`--draft auto` places an export only where there is one: with none, the device discovery (which
    imports onnxruntime, a part of every command's start) is skipped, and the chain serves."""
    from mirrorsd import devices
    from mirrorsd.runtime.drafters import exported

    monkeypatch.setenv("MIRRORSD_CACHE", str(tmp_path))
    asked = []
    monkeypatch.setattr(devices, "discover", lambda: asked.append(1) or devices.discovery.discover())
    assert exported.auto_export_drafter(tokenizer) is None and asked == []
    (tmp_path / "exports" / "some-export").mkdir(parents=True)
    (tmp_path / "exports" / "some-export" / "manifest.json").write_text("{}")
    assert exported.auto_export_drafter(tokenizer) is None and asked == [1]  # an export: devices are asked
