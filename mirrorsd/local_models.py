"""GGUF models other tools already keep on this machine, read in place under stable names a model argument takes:

- `ollama:MODEL:TAG` (`ollama:NAMESPACE/MODEL:TAG` outside ollama's library): ollama's store, `$OLLAMA_MODELS`
  or `~/.ollama/models`, whose manifests name the blob holding each model's GGUF;
- `lmstudio:PUBLISHER/REPO/FILE.gguf`: LM Studio's models folder, `~/.lmstudio/models` (or the older
  `~/.cache/lm-studio/models`);
- `hf:ORG/NAME/FILE.gguf`: GGUF files in the Hugging Face cache (`$HF_HUB_CACHE`, `$HF_HOME/hub` or
  `~/.cache/huggingface/hub`). A cached safetensors model needs no name of its own: its hub id loads from the
  cache.

Nothing is copied: an ollama blob, whose file name has no `.gguf`, is reached through a link in mirrorsd's cache.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from mirrorsd.errors import ModelNotFoundError

log = logging.getLogger(__name__)
PREFIXES = ("ollama:", "lmstudio:", "hf:")
OLLAMA_LIBRARY = ("registry.ollama.ai", "library")
MODEL_LAYER = "application/vnd.ollama.image.model"


@dataclass(frozen=True)
class LocalModel:
    name: str  # what --target takes
    path: Path  # the GGUF file itself
    size: int  # bytes


def ollama_root() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


def lmstudio_roots() -> list[Path]:
    return [Path.home() / ".lmstudio" / "models", Path.home() / ".cache" / "lm-studio" / "models"]


def hf_root() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface").expanduser()
    return home / "hub"


def discover() -> list[LocalModel]:
    """Every GGUF model of ollama, LM Studio and the Hugging Face cache found here, by name."""
    return sorted([m for scan in STORES.values() for m in scan()], key=lambda m: m.name)


def _ollama() -> list[LocalModel]:
    root = ollama_root()
    manifests = root / "manifests"
    found = []
    for manifest in sorted(p for p in manifests.rglob("*") if p.is_file()) if manifests.is_dir() else ():
        parts = manifest.relative_to(manifests).parts
        if len(parts) != 4:
            continue
        registry, namespace, model, tag = parts
        try:
            layers = json.loads(manifest.read_text())["layers"]
            layer = next(x for x in layers if x.get("mediaType") == MODEL_LAYER)
            blob = root / "blobs" / layer["digest"].replace(":", "-")
        except (OSError, ValueError, KeyError, TypeError, StopIteration, AttributeError) as exc:
            log.warning("skipping ollama manifest %s: %s", manifest, exc)
            continue
        if blob.is_file():
            where = model if (registry, namespace) == OLLAMA_LIBRARY else f"{namespace}/{model}"
            found.append(LocalModel(f"ollama:{where}:{tag}", blob, blob.stat().st_size))
    return found


def _lmstudio() -> list[LocalModel]:
    found = []
    for root in lmstudio_roots():
        for path in sorted(root.rglob("*.gguf")) if root.is_dir() else ():
            found.append(LocalModel(f"lmstudio:{path.relative_to(root).as_posix()}", path, path.stat().st_size))
    return found


def _hf_cache() -> list[LocalModel]:
    found = []
    for path in sorted(hf_root().glob("models--*/snapshots/*/*.gguf")):
        repo = path.parents[2].name.removeprefix("models--").replace("--", "/")
        found.append(LocalModel(f"hf:{repo}/{path.name}", path, path.stat().st_size))
    return found


STORES = {"ollama": _ollama, "lmstudio": _lmstudio, "hf": _hf_cache}  # a name's prefix -> its store's scan


def resolve_local(spec: str) -> str:
    """A `.gguf` path for a local name (ollama:, lmstudio:, hf:), or `spec` unchanged for anything else."""
    if not spec.startswith(PREFIXES):
        return spec
    models = STORES[spec.split(":", 1)[0]]()  # only the store the name is from
    wanted = {spec, spec + ":latest"} if spec.startswith("ollama:") else {spec}
    match = next((m for m in models if m.name in wanted), None)
    if match is None:
        same = [m.name for m in models]
        raise ModelNotFoundError(f"no model {spec!r} on this machine",
                                 ("found: " + ", ".join(same)) if same else "`mirrorsd models` lists what is here")
    return str(_as_gguf(match))


def _as_gguf(model: LocalModel) -> Path:
    """The model's GGUF under a name ending in .gguf: the file itself, or a link to an ollama blob."""
    if model.path.suffix == ".gguf":
        return model.path
    from mirrorsd.catalog import cache_dir

    link = cache_dir() / "local" / (model.name.replace(":", "_").replace("/", "_") + ".gguf")
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.is_symlink() or link.resolve() != model.path.resolve():
        tmp = link.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(model.path)
        tmp.replace(link)
    return link
