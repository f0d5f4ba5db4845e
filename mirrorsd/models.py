"""Turning a model argument into a loaded transformers model and tokenizer.

A model argument is one of: a catalog name (`mirrorsd models`), a local Hugging Face folder, a
.gguf file (converted once into the cache), or a Hugging Face hub id (only where the hub is
reachable; nothing in the tests or the default run needs it).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mirrorsd import catalog
from mirrorsd.errors import ModelNotFoundError
from mirrorsd.local_models import PREFIXES as LOCAL_PREFIXES
from mirrorsd.local_models import resolve_local


def resolve_model_path(spec: str, progress: bool = False) -> str:
    """Local folder (or hub id) that transformers can load for `spec`."""
    spec = resolve_local(spec)
    if spec in catalog.CATALOG:
        return str(catalog.ensure(spec, progress=progress))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {spec!r} does not exist", "check the path")
        return str(catalog.convert_gguf_file(path, progress=progress))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"{spec!r} is a folder but not a Hugging Face model folder (no config.json)",
                "point at the folder holding config.json and the weights, or at a .gguf file",
            )
        return str(path)
    looks_like_hub_id = spec.count("/") == 1 and not spec.startswith((".", "/", "~")) and not path.exists()
    if looks_like_hub_id:
        return _hub_model(spec)
    raise ModelNotFoundError(
        f"unknown model {spec!r}: not a catalog name, a local model folder, a .gguf file or a hub id",
        f"catalog models that work offline: {', '.join(catalog.CATALOG)} (see `mirrorsd models`)",
    )


def _hub_model(spec: str) -> str:
    """A hub id: its folder in the local Hugging Face cache, else the id itself where the hub can be reached;
    otherwise a clear error at once (transformers would retry for about a minute first)."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(spec, local_files_only=True)
    except Exception:  # not cached (any of huggingface_hub's errors for it): the hub decides
        pass
    if not hub_reachable():
        raise ModelNotFoundError(
            f"{spec!r} looks like a Hugging Face hub id, but it is not in the local cache and the hub cannot be "
            "reached (offline, or HF_HUB_OFFLINE is set)",
            f"work offline with a catalog model ({', '.join(catalog.CATALOG)}), a local model folder or a .gguf "
            "file; or connect to the network and try again")
    return spec


def hub_reachable(timeout_s: float = 1.5) -> bool:
    """Whether the Hugging Face hub answers a TCP connection (HF_ENDPOINT's host) within `timeout_s`."""
    import os
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def resolve_gguf(spec: str, progress: bool = False) -> tuple[Path, Path]:
    """(GGUF file, tokenizer folder) for a model argument that is a GGUF: a catalog name, a .gguf path, or a model
    of another tool's store (ollama:, lmstudio:, hf:)."""
    spec = resolve_local(spec)
    if spec in catalog.CATALOG:
        gguf = catalog.ensure_gguf(spec, progress=progress)
    else:
        gguf = Path(spec).expanduser()
        if gguf.suffix != ".gguf":
            raise ModelNotFoundError(f"{spec!r} is not a GGUF model: the llama.cpp backend runs GGUF files",
                                     "give a catalog name or a .gguf file, or use --backend torch")
        if not gguf.is_file():
            raise ModelNotFoundError(f"GGUF file {spec!r} does not exist", "check the path")
        check_gguf_structure(gguf)
    return gguf, catalog.gguf_tokenizer(gguf, progress)


def check_gguf_structure(path: Path) -> None:
    """A GGUF given by path has no digest to check against: at least its header parses and every tensor's
    data lies inside the file (a truncated or overwritten file is a clear error, not garbage output)."""
    import gguf

    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(str(path))
        ends = [int(t.data_offset) + int(t.n_bytes) for t in reader.tensors]
    except Exception as exc:  # noqa: BLE001 - gguf-py raises ValueError, IndexError, struct and numpy errors
        raise ModelNotFoundError(f"{path.name} is not a readable GGUF file: {exc}",
                                 "the file may be truncated or corrupt: download it again") from None
    if not ends:
        raise ModelNotFoundError(f"{path.name} holds no tensors", "is it a model file? download it again")
    if max(ends) > size:
        raise ModelNotFoundError(f"{path.name} is truncated: its tensors need {max(ends)} bytes, the file has {size}",
                                 "download the file again")


def is_gguf(spec: str) -> bool:
    """Whether a model argument names a GGUF file (every catalog model is one, and every model of another
    tool's store: mirrorsd/local_models.py)."""
    return spec in catalog.CATALOG or Path(spec).suffix == ".gguf" or spec.startswith(LOCAL_PREFIXES)


GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(folder: str | Path):
    """What AutoTokenizer loads from `folder`. Where the folder names transformers' generic tokenizers backend
    (the catalog's tokenizer folders do), that class is loaded directly: AutoTokenizer's first use imports the
    module index of every model transformers knows, about half a second of a command's start."""
    import json

    try:
        named = json.loads((Path(folder) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        named = None
    if named in GENERIC_TOKENIZERS:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def load_model(spec: str, device: torch.device, dtype: torch.dtype, progress: bool = False):
    """(model, tokenizer) for a model argument, on `device` in `dtype`, in eval mode."""
    path = resolve_model_path(spec, progress=progress)  # first: a model that is not there costs no import
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not progress:
        hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a broken folder
        if spec in catalog.CATALOG:  # our own cache entry is broken: rebuild it once, from the GGUF
            catalog.invalidate(spec)
            path = resolve_model_path(spec, progress=progress)
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
            return model.to(device).eval(), tokenizer
        hub = isinstance(exc, OSError) and not Path(spec).exists()
        raise ModelNotFoundError(
            f"could not load model {spec!r}: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}",
            "hub ids need a reachable Hugging Face hub; offline, use a catalog name "
            f"({', '.join(catalog.CATALOG)}), a local folder or a .gguf file" if hub else
            "the folder is not a loadable transformers model (check its config.json and weights), or use a "
            "catalog name / a .gguf file",
        ) from exc
    return model.to(device).eval(), tokenizer
