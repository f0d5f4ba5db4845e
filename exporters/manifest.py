"""Writing manifest.json (its format, and reading it, live in mirrorsd.export_format)."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

from mirrorsd.export_format import FORMAT_VERSION, MANIFEST


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


