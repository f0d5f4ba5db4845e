"""manifest.json: what an export holds, so a runtime can load it and check it against the target."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

from mirrorsd.errors import ExportError, TokenizerMismatchError

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def tool_versions() -> dict[str, str]:
    versions = {}
    for pkg in ("mirrorsd", "torch", "transformers", "onnx", "onnxruntime", "onnxscript", "coremltools"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return versions


def io_spec(names: list[str], shapes: list[list], dtypes: list[str]) -> list[dict]:
    return [{"name": n, "shape": s, "dtype": d} for n, s, d in zip(names, shapes, dtypes)]


def write_manifest(folder: Path, manifest: dict) -> Path:
    path = Path(folder) / MANIFEST
    path.write_text(json.dumps({"format_version": FORMAT_VERSION, **manifest}, indent=1))
    return path


def is_export(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def read_manifest(folder: str | Path) -> dict:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise ExportError(f"{folder} holds no {MANIFEST}: not a mirrorsd export",
                          "create one with `mirrorsd export --model NAME --out DIR`")
    try:
        manifest = json.loads(path.read_text())
        for key in ("format", "profile", "graphs", "dims", "max_context", "tokenizer"):
            manifest[key]  # noqa: B018 - presence check
    except (ValueError, KeyError, TypeError) as exc:
        raise ExportError(f"{path} is not a valid mirrorsd manifest ({exc})", "re-run `mirrorsd export`") from exc
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ExportError(f"{path} has format version {manifest.get('format_version')}, this mirrorsd reads "
                          f"{FORMAT_VERSION}", "re-run `mirrorsd export` with this version of mirrorsd")
    return manifest


def check_tokenizer(manifest: dict, target_tokenizer, target_name: str, folder: str | Path) -> None:
    """The export must come from a model with the target's tokenizer (same fingerprint)."""
    from mirrorsd.runtime.datastore import tokenizer_fingerprint

    want = tokenizer_fingerprint(target_tokenizer)
    have = manifest["tokenizer"]["fingerprint"]
    if have != want:
        raise TokenizerMismatchError(
            f"the exported draft in {folder} (from {manifest.get('model')!r}, tokenizer {have[:12]}) does not share "
            f"the {target_name}'s tokenizer ({want[:12]}): its token ids would mean other text",
            f"export a draft from {target_name}'s model family, e.g. `mirrorsd export --model <small sibling> "
            "--out DIR`, or use a model-free drafter (--draft auto)",
        )
