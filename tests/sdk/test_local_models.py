"""Models other tools keep on this machine, found in stores laid out as ollama, LM Studio and the Hugging Face
cache lay them out (built in temporary folders), listed by `mirrorsd models` and run by name, read in place: the
same tokens as the catalog model whose file they hold."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from helpers import run
from mirrorsd import catalog
from mirrorsd.errors import ModelNotFoundError
from mirrorsd.local_models import discover, resolve_local


def ollama_store(root: Path, gguf: Path, model: str, tag: str, namespace: str = "library") -> Path:
    """An ollama store: manifests/<registry>/<namespace>/<model>/<tag> naming blobs/sha256-<digest>."""
    digest = hashlib.sha256(f"{namespace}/{model}:{tag}".encode()).hexdigest()  # the real one is the file's
    blob = root / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(gguf, blob)  # ollama's blob is the GGUF itself, under its digest
    manifest = root / "manifests" / "registry.ollama.ai" / namespace / model / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64, "size": 10},
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": 1}]}))
    return blob


@pytest.fixture
def home(tmp_path, monkeypatch):
    for var in ("OLLAMA_MODELS", "HF_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MIRRORSD_CACHE", str(tmp_path / "mirrorsd-cache"))
    return tmp_path


def test_each_store_is_found_under_its_names(home):
    gguf = home / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 100)
    blob = ollama_store(home / ".ollama" / "models", gguf, "qwen2.5-coder", "1.5b")
    other = ollama_store(home / ".ollama" / "models", gguf, "tiny", "latest", namespace="someone")
    lms = home / ".lmstudio" / "models" / "pub" / "repo" / "repo-Q4_K_M.gguf"
    hf = home / ".cache" / "huggingface" / "hub" / "models--org--name" / "snapshots" / "abc123" / "name-q8_0.gguf"
    for path in (lms, hf):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"GGUF")
    (home / ".ollama" / "models" / "manifests" / "registry.ollama.ai" / "library" / "broken").mkdir()
    (home / ".ollama" / "models" / "manifests" / "registry.ollama.ai" / "library" / "broken" / "x").write_text("{")
    names = {m.name: m.path for m in discover()}
    assert names == {"ollama:qwen2.5-coder:1.5b": blob, "ollama:someone/tiny:latest": other,
                     "lmstudio:pub/repo/repo-Q4_K_M.gguf": lms, "hf:org/name/name-q8_0.gguf": hf}
    linked = Path(resolve_local("ollama:qwen2.5-coder:1.5b"))
    assert linked.suffix == ".gguf" and linked.resolve() == gguf.resolve()  # a link: nothing copied
    assert resolve_local("ollama:someone/tiny") == resolve_local("ollama:someone/tiny:latest")  # the default tag
    assert resolve_local("lmstudio:pub/repo/repo-Q4_K_M.gguf") == str(lms)
    with pytest.raises(ModelNotFoundError, match="no model 'ollama:llama3'") as err:
        resolve_local("ollama:llama3")
    assert "ollama:qwen2.5-coder:1.5b" in err.value.hint
    assert resolve_local("smollm2-135m") == "smollm2-135m"  # anything else passes through


@pytest.mark.integration
def test_an_ollama_model_runs_by_name_with_the_catalog_models_tokens(tmp_path):
    gguf = catalog.ensure_gguf("smollm2-135m", progress=False)
    ollama_store(tmp_path / "ollama", gguf, "smollm2", "135m")
    env = {"OLLAMA_MODELS": str(tmp_path / "ollama")}
    listed = run("models", env=env)
    assert listed.returncode == 0 and "ollama:smollm2:135m" in listed.stdout
    common = ["--backend", "llamacpp", "--draft", "ngram", "--max-new-tokens", "12", "--json", "Say hello."]
    theirs = run("generate", "--target", "ollama:smollm2:135m", *common, env=env)
    ours = run("generate", "--target", "smollm2-135m", *common, env=env)
    assert theirs.returncode == 0, theirs.stderr
    assert json.loads(theirs.stdout)["token_ids"] == json.loads(ours.stdout)["token_ids"]
    assert json.loads(theirs.stdout)["model"] == "ollama:smollm2:135m"
