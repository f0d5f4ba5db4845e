"""`mirrorsd handoff`: the folder vLLM serves from (speculative config, linked model folders, serve.sh, the record
of where K came from), taken from arguments or an eval-drafts report; our retrieval and chain drafters as vLLM
custom_class proposers over your datastore; what cannot be handed off and broken reports are clear errors."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from conftest import make_model
from helpers import run
from mirrorsd.apps.handoff.folder import plan_handoff, write_handoff
from mirrorsd.drafters import NGramDrafter, build_datastore
from mirrorsd.errors import ConfigError, DatastoreError, TokenizerMismatchError


@pytest.fixture(scope="module")
def draft_folder(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("draft")
    make_model(tokenizer, seed=1).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_an_ngram_handoff_carries_our_ngram_range_and_k(tiny_folder, tmp_path):
    out = write_handoff(plan_handoff(str(tiny_folder), "ngram", 6, None), str(tmp_path / "out"), dtype="float32",
                        link=True)
    config = json.loads((out / "speculative_config.json").read_text())
    ours = NGramDrafter()
    assert config == {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": ours.max_ngram,
                      "prompt_lookup_min": ours.min_ngram}
    assert os.path.realpath(out / "target") == os.path.realpath(tiny_folder) and not (out / "draft").exists()
    assert "links to this host's mirrorsd cache" in (out / "README.md").read_text()
    serve = (out / "serve.sh").read_text()
    assert os.access(out / "serve.sh", os.X_OK) and "--speculative-config" in serve and "--tensor-parallel-size" in serve
    assert json.loads((out / "handoff.json").read_text())["k_from"] == "given (--k)"


def test_a_draft_model_handoff_links_the_draft_and_takes_k_from_the_report(tiny_folder, draft_folder, tmp_path):
    report = tmp_path / "eval-drafts.json"
    figures = {"best_k": 5, "acceptance_rate": 0.61, "alpha": 0.8, "measured_speedup": 1.4}
    report.write_text(json.dumps({"target": str(tiny_folder), "recommendation": {"drafter": str(draft_folder), "k": 5},
                                  "candidates": {str(draft_folder): figures, "ngram": {"best_k": 3}}}))
    plan = plan_handoff(None, None, None, str(report))
    out = write_handoff(plan, str(tmp_path / "out"), dtype="float32")
    assert json.loads((out / "speculative_config.json").read_text()) == {
        "method": "draft_model", "model": "./draft", "num_speculative_tokens": 5}
    assert (out / "draft" / "config.json").is_file() and not (out / "draft").is_symlink()
    record = json.loads((out / "handoff.json").read_text())
    assert record["measured_here"] == figures and "eval-drafts" in record["k_from"]
    assert "0.61" in (out / "README.md").read_text()
    assert plan_handoff(None, "ngram", None, str(report)).k == 3  # the named drafter's own best K


def test_a_chain_handoff_runs_our_drafter_in_vllm_over_your_datastore(tiny_folder, tokenizer, tmp_path):
    corpus = tmp_path / "corpus.py"
    corpus.write_text("def add(a, b):\n    return a + b\n")
    build_datastore([corpus], tokenizer, tmp_path / "ds")
    out = write_handoff(plan_handoff(str(tiny_folder), f"chain:{tmp_path / 'ds'}", 5, None), str(tmp_path / "out"))
    assert json.loads((out / "speculative_config.json").read_text()) == {
        "method": "custom_class", "model": "mirrorsd.apps.handoff.vllm_proposer.ChainProposer", "num_speculative_tokens": 5}
    assert not (out / "datastore").is_symlink() and (out / "datastore" / "datastore.json").is_file()  # copied
    assert 'export MIRRORSD_DATASTORE="$PWD/datastore"' in (out / "serve.sh").read_text()
    assert "pip install --no-deps" in (out / "README.md").read_text()
    plain = write_handoff(plan_handoff(str(tiny_folder), "retrieval", 5, None), str(tmp_path / "plain"))
    assert json.loads((plain / "speculative_config.json").read_text())["model"].endswith("RetrievalProposer")
    assert not (plain / "datastore").exists()


def test_a_datastore_of_another_tokenizer_is_refused_before_vllm_starts(tiny_folder, tmp_path):
    from conftest import make_tokenizer

    corpus = tmp_path / "corpus.py"
    corpus.write_text("def add(a, b):\n    return a + b\n")
    build_datastore([corpus], make_tokenizer(vocab_size=280), tmp_path / "ds")
    with pytest.raises(DatastoreError, match="tokenizer"):
        write_handoff(plan_handoff(str(tiny_folder), f"retrieval:{tmp_path / 'ds'}", 5, None), str(tmp_path / "out"))


@pytest.mark.parametrize("args, words", [
    (("x", "auto", 4, None), "not one drafter"),
    (("x", "none", 4, None), "not one drafter"),
    (("x", "ngram", 0, None), "--k"),
])
def test_what_vllm_cannot_take_is_refused(args, words):
    with pytest.raises(ConfigError, match=words):
        plan_handoff(*args)


def test_a_broken_report_a_used_folder_and_another_tokenizer_are_clear_errors(tiny_folder, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not an eval-drafts report"):
        plan_handoff(None, None, None, str(bad))
    used = tmp_path / "used"
    used.mkdir()
    (used / "x").write_text("x")
    with pytest.raises(ConfigError, match="not an empty folder"):
        write_handoff(plan_handoff(str(tiny_folder), "ngram", 4, None), str(used))
    other_tokenizer = tmp_path / "other"
    from conftest import make_tokenizer

    small = make_tokenizer(vocab_size=280)
    make_model(small, seed=2).save_pretrained(other_tokenizer)
    small.save_pretrained(other_tokenizer)
    with pytest.raises(TokenizerMismatchError):
        write_handoff(plan_handoff(str(tiny_folder), str(other_tokenizer), 4, None), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_the_cli_writes_the_folder_and_refuses_other_engines(tiny_folder, tmp_path):
    r = run("handoff", str(tmp_path / "out"), "--target", str(tiny_folder), "--draft", "ngram", "--k", "4")
    assert r.returncode == 0 and "serve.sh" in r.stdout, r.stderr
    r = run("handoff", str(tmp_path / "out2"), "--to", "tgi", "--target", str(tiny_folder))
    assert r.returncode == 2 and "mirrorsd: error:" in r.stderr


def test_the_default_handoff_is_a_bfloat16_copy_that_moves_to_another_host(tiny_folder, tmp_path):
    """It was a link to a float32 folder: 538 MB for a 98 MB GGUF, undocumented, broken by `rm` or a copy."""
    from safetensors import safe_open

    out = write_handoff(plan_handoff(str(tiny_folder), "ngram", 4, None), str(tmp_path / "out"))
    assert not (out / "target").is_symlink()
    weights = next((out / "target").glob("*.safetensors"))
    with safe_open(weights, "pt") as f:
        assert {str(f.get_tensor(name).dtype) for name in f.keys()} == {"torch.bfloat16"}
    record = json.loads((out / "handoff.json").read_text())
    source = sum(p.stat().st_size for p in tiny_folder.glob("*.safetensors"))
    assert record["dtype"] == "bfloat16" and record["sizes_mb"]["target"] < source / 1e6  # half-size weights
    readme = (out / "README.md").read_text()
    assert "bfloat16 safetensors (target/ " in readme and "moves to another host" in readme
    moved = tmp_path / "elsewhere"
    shutil.copytree(out, moved)
    shutil.rmtree(out)  # the copy stands alone
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoModelForCausalLM.from_pretrained(moved / "target").dtype == torch.bfloat16
    assert AutoTokenizer.from_pretrained(moved / "target").chat_template
    with pytest.raises(ConfigError, match="--link"):
        write_handoff(plan_handoff(str(tiny_folder), "ngram", 4, None), str(tmp_path / "x"), link=True)
