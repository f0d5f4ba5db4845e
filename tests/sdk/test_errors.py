"""Bad input: each a clear mirrorsd error type, with a message and a hint."""

from __future__ import annotations

import json
import pytest

from mirrorsd import (ConfigError, Engine, GenerationConfig, MirrorsdError, ModelNotFoundError, PromptError,
                      RollbackUnsupportedError, TokenizerMismatchError)
from mirrorsd.runtime.backends.torch_lm import TorchCausalLM
from mirrorsd.tokenizer_check import check_tokenizers_match
from conftest import make_model, make_tokenizer


def test_empty_prompt(target_model, tokenizer):
    engine = Engine(target_model, tokenizer)
    for empty in ("", [], ()):
        with pytest.raises(PromptError, match="empty"):
            engine.generate(empty)


def test_prompt_longer_than_the_context_window(target_model, tokenizer):
    engine = Engine(target_model, tokenizer)
    with pytest.raises(PromptError, match="context window is 256") as info:
        engine.generate("hello world " * 200)
    assert "shorten the prompt" in info.value.hint


def test_generation_stops_at_the_context_limit(target_model, tokenizer):
    engine = Engine(target_model, tokenizer)
    engine.eos_ids = frozenset()
    ids = tokenizer("hello world " * 20)["input_ids"]
    result = engine.generate(ids, GenerationConfig(max_new_tokens=500))
    assert len(ids) + len(result.token_ids) == 256 and result.finish_reason == "length"


@pytest.mark.parametrize("kwargs,match", [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": -3}, "max_new_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"temperature": float("inf")}, "temperature"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"num_draft_tokens": 1.5}, "num_draft_tokens"),
    ({"num_draft_tokens": 0}, "num_draft_tokens"),
    ({"num_draft_tokens": 10**9}, "num_draft_tokens"),
    ({"max_draft_tokens": 10**9}, "max_draft_tokens"),
    ({"temperature": "0.7"}, "temperature"),
    ({"top_k": None}, "top_k"),
    ({"stop": ""}, "stop"),
    ({"stop": [None]}, "stop"),
    ({"seed": -1}, "seed"),
    ({"adaptive_k": "yes"}, "adaptive_k"),
])
def test_invalid_generation_settings(kwargs, match):
    with pytest.raises(ConfigError, match=match) as info:
        GenerationConfig(**kwargs)
    assert info.value.hint and isinstance(info.value, ValueError)


def test_the_earlier_pipeline_spelling_is_the_pipeline_off():
    from mirrorsd.config import SpeculativeConfig

    assert GenerationConfig(pipeline="sequential").pipeline == "off" == GenerationConfig(pipeline="sequential").speculative.pipeline
    assert SpeculativeConfig(pipeline="sequential").pipeline == "off"


def test_settings_beside_a_config_are_checked_and_a_bare_stop_string_is_one_stop(target_model, tokenizer):
    engine = Engine(target_model, tokenizer, None)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        engine.generate("hi", GenerationConfig(max_new_tokens=4), max_new_tokens=True)
    with pytest.raises(ConfigError, match="unknown generation setting"):
        engine.generate("hi", GenerationConfig(), max_tokens=4)
    assert GenerationConfig(stop="abc").stop == ("abc",)  # documented: one stop, not three letters
    assert engine.generate("hi", GenerationConfig(max_new_tokens=2), stop="abc").finish_reason == "length"


def test_unknown_model_names_the_catalog():
    with pytest.raises(ModelNotFoundError) as info:
        Engine.load(target="no-such-model-anywhere")
    assert "smollm2-135m" in info.value.hint


def test_folder_that_is_not_a_model(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        Engine.load(target=str(tmp_path))


def test_folder_with_an_empty_config_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError) as info:
        Engine.load(target=str(tmp_path), backend="torch")
    assert "config.json" in info.value.hint


def test_a_gguf_that_is_not_one_is_a_clear_error_and_leaves_no_cache_folder(tmp_path, monkeypatch):
    from mirrorsd.errors import MirrorsdError

    monkeypatch.setenv("MIRRORSD_CACHE", str(tmp_path / "cache"))
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not a gguf at all" * 100)
    with pytest.raises(MirrorsdError):
        Engine.load(target=str(fake), backend="torch")
    assert not list((tmp_path / "cache").rglob("*.json")) and not list((tmp_path / "cache").rglob("hf"))


def test_draft_of_a_wrong_type_is_a_config_error(target_model, tokenizer):
    with pytest.raises(ConfigError):
        Engine(target_model, tokenizer, 123)


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        Engine.load(target=str(tmp_path / "model.gguf"))


def test_mismatched_tokenizers_are_refused(tokenizer):
    other = make_tokenizer(corpus=["completely different text, other merges " * 3, "zzz yyy xxx"])
    with pytest.raises(TokenizerMismatchError) as info:
        check_tokenizers_match(tokenizer, other, "tiny-target", "tiny-draft")
    assert "tiny-draft" in str(info.value) and "ngram" in info.value.hint
    check_tokenizers_match(tokenizer, make_tokenizer())  # the same training gives the same tokenizer


def test_mismatched_draft_model_folder_is_refused_at_load(tmp_path, tokenizer):
    other_tok = make_tokenizer(corpus=["completely different text, other merges " * 3, "zzz yyy xxx"])
    for name, tok, seed in (("target", tokenizer, 0), ("draft", other_tok, 1)):
        make_model(tok, seed).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    with pytest.raises(TokenizerMismatchError):
        Engine.load(target=str(tmp_path / "target"), draft=str(tmp_path / "draft"), dtype="float32")


def test_model_whose_cache_cannot_roll_back_is_refused(tokenizer):
    model = make_model(tokenizer, 0)
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(RollbackUnsupportedError, match="linear_attention"):
        TorchCausalLM(model)


def test_all_errors_share_one_base():
    for cls in (ConfigError, PromptError, ModelNotFoundError, TokenizerMismatchError, RollbackUnsupportedError):
        assert issubclass(cls, MirrorsdError)


def test_a_trace_path_that_cannot_be_written_fails_before_generating(target_model, tokenizer, tmp_path):
    (tmp_path / "file").write_text("x")
    engine = Engine(target_model, tokenizer, None)
    for bad in (tmp_path / "file" / "trace.json", tmp_path / "missing" / "trace.json", tmp_path):
        with pytest.raises(ConfigError, match="cannot write the trace"):
            engine.stream("hi", trace=str(bad))


def test_text_that_is_not_unicode_is_a_prompt_error(tokenizer, target_model):
    from mirrorsd import Engine
    from mirrorsd.errors import ConfigError, PromptError

    engine = Engine(target_model, tokenizer, None)
    for prompt in ("a\ud800b", [{"role": "user", "content": "\udfff"}], "a\udcffb"):
        with pytest.raises(PromptError, match="not valid Unicode"):
            engine.generate(prompt, max_new_tokens=2)
    with pytest.raises(ConfigError, match="surrogate"):
        GenerationConfig(stop=("\ud800",))


@pytest.mark.slow  # the CLI as subprocesses
def test_argv_and_stdin_that_are_not_utf8_are_clear_errors(tiny_folder):
    import subprocess
    import sys as _sys

    base = [_sys.executable, "-m", "mirrorsd", "generate", "--target", str(tiny_folder), "--draft", "none",
            "--max-new-tokens", "2"]
    env = {**__import__("os").environ, "HF_HUB_OFFLINE": "1"}
    argv = subprocess.run([*base, "--raw", b"a\xffb"], capture_output=True, text=True, timeout=300, env=env)
    stdin = subprocess.run([*base, "-"], input=b"\xff\xfe", capture_output=True, timeout=300, env=env)
    for rc, err in ((argv.returncode, argv.stderr), (stdin.returncode, stdin.stderr.decode())):
        assert rc == 2 and "mirrorsd: error:" in err and "Traceback" not in err, err


@pytest.mark.parametrize("file", ["../outside.onnx", "/etc/passwd", "sub/decode.onnx", "..", 7, None])
def test_an_export_manifest_naming_a_graph_outside_its_folder_is_refused(tmp_path, file):
    from mirrorsd.errors import ExportError
    from mirrorsd.export_format import FORMAT_VERSION, MANIFEST, read_manifest

    manifest = {"format": "onnx", "format_version": FORMAT_VERSION, "profile": "dynamic", "dims": {},
                "max_context": 64, "tokenizer": {"fingerprint": "x"}, "graphs": {"decode": {"file": file}}}
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match="plain file name"):
        read_manifest(tmp_path)
    manifest["graphs"]["decode"]["file"] = "decode.onnx"
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    assert read_manifest(tmp_path)["graphs"]["decode"]["file"] == "decode.onnx"


def test_a_broken_chat_template_is_a_prompt_error_in_the_sdk_and_the_cli(tiny_folder, tmp_path, target_model):
    """A cached model whose chat_template.jinja was damaged: a clear error, not a jinja traceback."""
    import shutil

    from helpers import run

    folder = tmp_path / "broken-template"
    shutil.copytree(tiny_folder, folder)
    template = folder / "chat_template.jinja"
    if template.exists():
        template.write_text("{% for message in messages %}{{ message['content'] }")  # cut mid-tag
    else:  # an older transformers keeps the template in tokenizer_config.json
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = "{% for message in messages %}{{ message['content'] }"
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    from transformers import AutoTokenizer

    engine = Engine(target_model, AutoTokenizer.from_pretrained(folder), None, name="broken")
    with pytest.raises(PromptError, match="chat template"):
        engine.encode([{"role": "user", "content": "hi"}])
    out = run("generate", "--target", str(folder), "--draft", "none", "--max-new-tokens", "2", "hi")
    assert out.returncode == 2 and "chat template" in out.stderr and "Traceback" not in out.stderr, out.stderr
